"""The HTML report: self-contained and well formed, escaped, units, cost table, timeline geometry, bounds, CLI."""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

from meshscope.analysis.breakdown import break_down
from meshscope.cli import main
from meshscope.records import AXIS_CODE, KIND_CODE, OP_CODE, IntervalColumns, RecordTable, StepColumns, read_table
from meshscope.reports import timelines
from meshscope.reports.pages import render_report, write_report

DATA_DIR = Path(__file__).parent.parent / "data"
DP8 = DATA_DIR / "dp8_straggler" / "records.jsonl"
PP2 = DATA_DIR / "pp2_tp2_dp2_straggler" / "records.jsonl"
EVIL = '<img src=x onerror="alert(1)">&'


# ---------------------------------------------------------------------------- inputs


def dp8_analysis(job: str = "dp8-straggler") -> dict:
    """A hand-written ``Analysis.to_dict()`` for the dp8 scenario (rank 2 is 5 ms late into the step-0 all-reduce)."""
    suspect = {"rank": 2, "node": "node-0", "group": "dp:0", "message": "rank 2 on node-0 makes dp:0 wait 5.00 ms"}

    def row(category, label, expected, median, p95, worst_rank, worst, share, gpu_h, sus=None):
        return {
            "category": category,
            "label": label,
            "expected_seconds": expected,
            "measured_median_seconds": median,
            "measured_p95_seconds": p95,
            "worst_rank": worst_rank,
            "worst_seconds": worst,
            "share_of_step": share,
            "delta_seconds": None if expected is None else median - expected,
            "gpu_hours_per_day": gpu_h,
            "suspect": sus,
        }

    return {
        "job": job,
        "world_size": 8,
        "ranks_seen": 8,
        "steps": {"first": 0, "last": 1, "count": 2},
        "partial_data": [{"code": "inferred_group_size", "message": "2 groups carry no group_size", "count": 2}],
        "summary": {
            "median_step_seconds": 0.0465,
            "max_step_seconds": 0.049,
            "straggler_gap_seconds": 0.005,
            "slowest_rank": 2,
            "efficiency": 0.9,
            "ideal_step_seconds": 0.042,
            "useful_compute_share": 0.55,
            "reported_gpu_util": 0.97,
        },
        "rows": [
            row("compute", "compute", 0.026, 0.026, 0.031, 2, 0.031, 0.559, 107.3),
            row("comm.dp.transfer", "dp transfer", 0.010, 0.010, 0.010, 0, 0.010, 0.215, 41.3),
            row("comm.dp.sync_wait", "dp sync wait", 0.0, 0.0025, 0.005, 0, 0.005, 0.054, 10.3, suspect),
            row("data", "data wait", None, 0.006, 0.006, 0, 0.006, 0.129, 24.8),
            row("optimizer", "optimizer", 0.002, 0.002, 0.002, 0, 0.002, 0.043, 8.3),
        ],
        "expected_vs_measured": {
            "collectives": [collective_row(expected=8 << 20, measured=16 << 20)],
            "memory": [{"pp_rank": 0, "expected_bytes": 64 << 30, "measured_peak_bytes": 48 << 30}],
        },
        "findings": [
            {
                "code": "straggler",
                "severity": "warning",
                "message": "rank 2 on node-0 is 5.00 ms late into the dp all-reduce of step 0 " + EVIL,
                "evidence": {"rank": 2, "phase_seconds": 0.021, "peer_median_seconds": 0.016, "share_of_step": 0.1},
                "suspects": [{"rank": 2, "node": "node-0", "group": None}],
            }
        ],
    }


def collective_row(
    *, stage: int = 0, axis: str = "dp", op: str = "all_reduce", expected: float | None, measured: float | None, **kw
) -> dict:
    """One ``expected_vs_measured.collectives`` row (docs/cost-table.md); one instance per step on both sides."""
    both = expected is not None and measured is not None
    row = {
        "pp_rank": stage,
        "axis": axis,
        "op": op,
        "expected_bytes_per_step": expected,
        "measured_bytes_per_step": measured,
        "ratio": measured / expected if both else None,
        "delta_bytes_per_step": measured - expected if both else None,
        "measured_min_bytes_per_step": measured,
        "measured_max_bytes_per_step": measured,
        "expected_count_per_step": None if expected is None else 1,
        "measured_count_per_step": None if measured is None else 1,
        "expected_message_bytes": expected,
        "measured_message_bytes": measured,
        "share_of_rank_steps": None if measured is None else 1.0,
        "sized_share": None if measured is None else 1.0,
        "status": "match" if both and measured == expected else "differs",
    }
    return row | kw


def pp2_analysis() -> dict:
    """The stored ``Analysis.to_dict()`` of the pp2 scenario (see its make_records.py)."""
    return json.loads(PP2.with_name("analysis.json").read_text(encoding="utf-8"))


def dp8() -> tuple[RecordTable, object]:
    table = read_table(DP8)
    return table, break_down(table)


class _Checker(HTMLParser):
    """Fails on an end tag that does not close the innermost open element; records tags and attributes."""

    VOID = frozenset({"meta", "br", "img", "input", "link", "hr", "col", "wbr"})

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[str] = []
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def handle_endtag(self, tag):
        assert self.stack, f"</{tag}> with nothing open"
        assert self.stack[-1] == tag, f"</{tag}> closes <{self.stack[-1]}>"
        self.stack.pop()

    def handle_data(self, data):
        self.text.append(data)


def parse(doc: str) -> _Checker:
    checker = _Checker()
    checker.feed(doc)
    checker.close()
    assert checker.stack == [], f"unclosed: {checker.stack}"
    return checker


def panels(doc: str) -> list[str]:
    return doc.split('<figure class="panel">')[1:]


def rows_of(panel: str) -> dict[int, str]:
    out = {}
    for chunk in re.findall(r'<g transform="translate\(0,\d+\)">(.*?)</g>', panel):
        rank = int(re.search(r">rank (\d+)", chunk).group(1))
        out[rank] = chunk
    return out


def rects(chunk: str, cls: str) -> list[tuple[float, float]]:
    return [
        (float(x), float(w))
        for x, w in re.findall(rf'<rect x="([\d.]+)" y="\d+" width="([\d.]+)" height="\d+" class="{cls}"', chunk)
    ]


# ---------------------------------------------------------------------------- the document


def test_report_is_one_well_formed_self_contained_file():
    table, bd = dp8()
    doc = render_report(table, bd, dp8_analysis())
    checker = parse(doc)
    assert doc.startswith("<!DOCTYPE html>")
    tags = {t for t, _ in checker.tags}
    assert "script" not in tags
    assert "link" not in tags
    assert "iframe" not in tags
    for _, attrs in checker.tags:
        for name in ("src", "href"):
            assert attrs.get(name) is None, f"external reference {name}={attrs[name]!r}"
    assert "@import" not in doc
    assert set(re.findall(r"url\(([^)]*)\)", doc)) == {"#ms-hatch"}  # the only url(): the inline hatch pattern
    assert "http://" not in doc
    assert "https://" not in doc


def test_user_text_is_escaped_everywhere():
    table, bd = dp8()
    doc = render_report(table, bd, dp8_analysis(job=EVIL), title=f"title {EVIL}")
    assert EVIL not in doc
    assert "<img" not in doc
    checker = parse(doc)
    assert f"title {EVIL}" in "".join(checker.text)  # shown as text, exactly
    assert "rank 2 on node-0 is 5.00 ms late into the dp all-reduce of step 0 " + EVIL in "".join(checker.text)


def test_sections_and_numbers_with_units():
    table, bd = dp8()
    doc = render_report(table, bd, dp8_analysis())
    text = " ".join(parse(doc).text)
    for heading in ("Summary", "Findings (1)", "Cost table", "Per-rank step timeline", "Expected vs measured"):
        assert heading in text
    assert "46.50 ms" in text  # median step
    assert "90.0 %" in text  # efficiency
    assert "inferred_group_size" in text  # partial data is shown
    assert "16.00 MiB" in text  # measured message bytes
    assert "2.00×" in text  # measured / expected message bytes
    assert "48.00 GiB" in text
    # every numeric cell of the cost table carries a unit (or is an explicit dash)
    table_html = doc.split('<table class="cost">')[1].split("</table>")[0]
    cells = re.findall(r'<td class="num[^"]*">(.*?)</td>', table_html)
    assert len(cells) == 5 * 7
    for cell in cells:
        plain = re.sub(r"<[^>]+>", "", cell).strip()
        assert plain == "–" or re.search(r"\d (ms|µs|s|%|GPU·h)(?!\w)", plain), plain


def test_the_timeline_says_rank_where_the_run_had_no_gpu(tmp_path: Path) -> None:
    # A CPU run's timeline rows are ranks, not GPUs (the report said "One row per GPU" for every run)
    assert main(["report", str(DATA_DIR / "busy_nanogpt_beside_one_spinner"), "--out", str(tmp_path / "cpu")]) == 0
    assert main(["report", str(DP8), "--out", str(tmp_path / "gpu")]) == 0
    cpu = " ".join(parse((tmp_path / "cpu" / "report.html").read_text()).text)
    gpu = " ".join(parse((tmp_path / "gpu" / "report.html").read_text()).text)
    assert "One row per rank," in cpu
    assert "One row per GPU" not in cpu
    assert "One row per GPU," in gpu


def evm_rows(doc: str, title: str) -> list[list[str]]:
    """The plain text of every cell of the expected-vs-measured table under ``title``, row by row."""
    table = doc.split(f"<h3>{title}</h3>")[1].split("</table>", maxsplit=1)[0]
    body = table.split("<tbody>")[1]
    return [
        [re.sub(r"<[^>]+>", "", cell).strip() for cell in re.findall(r"<td[^>]*>(.*?)</td>", tr)]
        for tr in re.findall(r"<tr>(.*?)</tr>", body)
    ]


PER_STAGE = "Collective bytes per GPU per step, by pipeline stage"


def test_collectives_per_stage_table_shows_bytes_counts_ratio_and_status():
    table, bd = dp8()
    analysis = dp8_analysis()
    mib = 1 << 20
    analysis["expected_vs_measured"]["collectives"] = [
        collective_row(expected=8 * mib, measured=8 * mib),
        collective_row(
            stage=1,
            axis="tp",
            op="all_gather",
            expected=64 * mib,
            measured=56 * mib,
            measured_min_bytes_per_step=0,
            measured_max_bytes_per_step=64 * mib,
            share_of_rank_steps=0.5,
            expected_count_per_step=16,
            measured_count_per_step=2,
            expected_message_bytes=4 * mib,
            measured_message_bytes=28 * mib,
        ),
        collective_row(stage=1, axis="pp", op="send_recv", expected=2 * mib, measured=None, status="plan_only"),
        collective_row(stage=1, axis="ep", op="all_to_all", expected=4 * mib, measured=None, status="no_sizes")
        | {"measured_count_per_step": 4},
    ]
    doc = render_report(table, bd, analysis)
    parse(doc)
    head = doc.split(f"<h3>{PER_STAGE}</h3>")[1].split("</thead>")[0]
    for column in ("expected / step", "measured / step", "measured / expected", "delta / step", "status"):
        assert column in head
    assert "not the bus bytes" in doc
    rows = evm_rows(doc, PER_STAGE)
    assert rows[0] == ["0", "dp", "all_reduce", "8.00 MiB", "8.00 MiB", "1.00×", "0 B", "1", "1", "8.00 MiB",
                       "8.00 MiB", "match"]  # fmt: skip
    assert rows[1][:11] == ["1", "tp", "all_gather", "64.00 MiB", "56.00 MiB", "0.88×", "-8.00 MiB", "16", "2",
                            "4.00 MiB", "28.00 MiB"]  # fmt: skip
    assert rows[1][11] == "differs, on 50.0 % of rank-steps; rank-steps differ: 0 B to 64.00 MiB"
    assert rows[2][3:5] == ["2.00 MiB", "–"]
    assert rows[2][11] == "not in the records"
    assert rows[3][7:9] == ["1", "4"]  # the records ran it, without sizes
    assert rows[3][11] == "no sizes recorded"
    assert '<td class="worse">differs' in doc


def test_collectives_per_stage_table_over_the_limit_keeps_every_row_that_differs():
    table, bd = dp8()
    analysis = dp8_analysis()
    rows = [collective_row(stage=s, expected=1 << 20, measured=1 << 20) for s in range(250)]
    for s in (3, 120, 249):
        rows[s] = collective_row(stage=s, expected=1 << 20, measured=2 << 20)
    analysis["expected_vs_measured"]["collectives"] = rows
    doc = render_report(table, bd, analysis)
    shown = evm_rows(doc, PER_STAGE)
    assert len(shown) == 200
    assert [r[0] for r in shown if r[-1] == "differs"] == ["3", "120", "249"]
    assert [int(r[0]) for r in shown] == sorted(int(r[0]) for r in shown)  # still in stage order
    assert "50 matching rows left out." in doc


def test_a_runs_exact_table_by_message_size_is_shown_beside_the_bytes():
    table, bd = dp8()
    analysis = dp8_analysis()
    analysis["expected_vs_measured"]["collectives_by_size"] = [
        {"stage": 0, "axis": "dp", "op": "all_reduce", "message_bytes": 8 << 20, "expected_count": 1,
         "measured_count": 1, "match": True},
    ]  # fmt: skip
    doc = render_report(table, bd, analysis)
    assert PER_STAGE in doc
    exact = evm_rows(doc, "Collectives per stage and message size: instances per step (meshscope run)")
    assert exact == [["0", "dp", "all_reduce", "8.00 MiB", "1", "1", "yes", "1.00×"]]


def test_cost_table_has_one_row_per_category_with_its_suspect():
    table, bd = dp8()
    doc = render_report(table, bd, dp8_analysis())
    body = doc.split('<table class="cost">')[1].split("</table>")[0].split("<tbody>")[1]
    trs = re.findall(r"<tr>(.*?)</tr>", body)
    assert [re.sub(r"<[^>]+>", "", tr.split("</td>")[0]).strip() for tr in trs] == [
        "compute",
        "dp transfer",
        "dp sync wait",
        "data wait",
        "optimizer",
    ]
    sync = trs[2]
    assert "rank 2 · node-0 · dp:0" in sync
    assert "url(#ms-hatch)" in sync  # the sync-wait swatch is hatched like the timeline
    assert "+2.50 ms" in sync  # delta vs the expected 0 s
    assert "worse" in sync


def test_without_a_plan_the_expected_and_delta_columns_are_left_out():
    table, bd = dp8()
    analysis = dp8_analysis()
    for row in analysis["rows"]:
        row["expected_seconds"] = row["delta_seconds"] = None
    doc = render_report(table, bd, analysis)
    head = doc.split('<table class="cost">')[1].split("</thead>")[0]
    assert "expected" not in head
    assert "delta" not in head
    assert "measured median" in head
    assert "--spec FILE adds the expected numbers" in doc
    first = doc.split('<table class="cost">')[1].split("<tbody>")[1].split("</tr>")[0]
    assert len(re.findall(r'<td class="num', first)) == 5


def test_only_meaningful_suspects_are_tagged_on_the_timeline():
    """A transfer row names its worst rank even when the cost is spread evenly; that is no reason to tag a rank."""
    table, bd = dp8()
    analysis = dp8_analysis()
    analysis["summary"]["slowest_rank"] = None
    analysis["findings"] = []
    analysis["rows"][1]["suspect"] = {"rank": 5, "node": "node-1", "group": "dp:0", "message": "spread evenly"}
    rows = rows_of(panels(render_report(table, bd, analysis))[0])
    assert "suspect" in rows[2]  # the dp sync-wait row's suspect
    assert "suspect" not in rows[5]


def test_empty_and_null_analysis_still_renders():
    table, bd = dp8()
    analysis = {
        "job": "j",
        "summary": dict.fromkeys(dp8_analysis()["summary"]),
        "rows": [],
        "findings": [],
        "expected_vs_measured": {"collectives": [], "memory": []},
        "partial_data": [],
    }
    doc = render_report(table, bd, analysis)
    parse(doc)
    assert "No findings" in doc
    assert "Nothing to compare" in doc
    assert "Partial data" not in doc


# ---------------------------------------------------------------------------- the timeline


def test_timeline_rows_and_hatched_sync_wait_geometry():
    """Step 0 lasts 49 ms; seven ranks wait 32 -> 37 ms for rank 2: their hatch spans 32/49 .. 37/49 of the plot."""
    table, bd = dp8()
    doc = render_report(table, bd, dp8_analysis())
    slowest, median = panels(doc)
    assert "Slowest step: step 0" in slowest
    assert "Median step: step 1" in median
    rows = rows_of(slowest)
    assert sorted(rows) == list(range(8))
    px = timelines._PLOT_W / 49_000
    for rank, chunk in rows.items():
        assert "node-" in chunk
        assert f"dp={rank} tp=0 pp=0" in chunk
        waits = rects(chunk, "k-wait")
        if rank == 2:
            assert waits == []
            assert "slowest" in chunk  # busiest apart from waiting
            assert "suspect" in chunk  # named by the analysis
        else:
            assert len(waits) == 1
            x, w = waits[0]
            assert x == pytest.approx(timelines._LABEL_W + 32_000 * px, abs=0.06)
            assert w == pytest.approx(5_000 * px, abs=0.06)
        # the dp all-reduce itself is drawn (from the rank's arrival to 47 ms)
        ((x, w),) = rects(chunk, "k-dp")
        arrival = 37_000 if rank == 2 else 32_000
        assert x == pytest.approx(timelines._LABEL_W + arrival * px, abs=0.06)
        assert x + w == pytest.approx(timelines._LABEL_W + 47_000 * px, abs=0.11)
    assert all(rects(chunk, "k-wait") == [] for chunk in rows_of(median).values())
    assert 'pattern id="ms-hatch"' in doc
    assert "Showing all 8 ranks" in doc


def test_timeline_uses_aligned_clocks():
    """pp2 scenario: node-1's clock is 2.5 ms ahead; aligned, every rank's step bar starts at the same x."""
    table = read_table(PP2)
    doc = render_report(table, break_down(table), pp2_analysis())
    for panel in panels(doc):
        starts = {rects(chunk, "bg")[0][0] for chunk in rows_of(panel).values()}
        assert starts == {float(timelines._LABEL_W)}


def test_legend_lists_what_the_job_used():
    table = read_table(PP2)
    doc = render_report(table, break_down(table), pp2_analysis())
    legend = doc.split('<div class="legend">')[1].split("</div>")[0]
    for label in ("compute: forward", "compute: backward", "data wait", "optimizer", "comm dp", "comm tp", "p2p"):
        assert label in legend
    assert "checkpoint" not in legend  # not in this job
    assert "sync wait" in legend


# ---------------------------------------------------------------------------- bounds


def big_job(*, tp: int = 8, dp: int = 256, pp: int = 8, tp_calls: int = 4, late_rank: int = 1234) -> RecordTable:
    """A job built from arrays: per rank-step data, forward, tp all-reduces, dp all-reduce, backward, optimizer.

    ``late_rank`` computes 3 ms longer and enters the dp all-reduce 3 ms after everyone else, in both steps.
    """
    world, steps = tp * dp * pp, 2
    rank = np.tile(np.arange(world), steps)
    step = np.repeat(np.arange(steps), world)
    t, d, p = rank % tp, (rank // tp) % dp, rank // (tp * dp)
    coord = np.stack([d, t, p, 0 * rank, 0 * rank], axis=1)
    base = step * 100_000
    n = rank.size
    cols: dict[str, list] = {k: [] for k in ("kind", "start", "end", "axis", "op", "group", "seq", "bytes", "gsize")}

    def add(kind, start, end, axis=-1, op=-1, group=-1, seq=-1, size=-1, gsize=-1):
        for key, value in zip(cols, (KIND_CODE[kind], start, end, axis, op, group, seq, size, gsize), strict=True):
            cols[key].append(np.broadcast_to(value, (n,)))

    add("data", base, base + 1_000)
    add("compute", base + 1_000, base + 15_000)
    gap = 2_000 // tp_calls
    for k in range(tp_calls):
        a = base + 15_000 + k * gap
        add(
            "comm", a, a + max(1, gap * 4 // 5), AXIS_CODE["tp"], OP_CODE["all_reduce"], d + dp * p, step * tp_calls + k
        )
    arrive = base + 17_000 + np.where(rank == late_rank, 3_000, 0)
    add("compute", base + 17_000, arrive)  # the late rank computes 3 ms longer (zero-length for the others)
    dp_group = dp * pp + t + tp * p
    # Its dp group leaves the all-reduce 5 ms after the last arrival: 3 ms later than every other group.
    done = base + 22_000 + np.where(dp_group == dp_group[late_rank], 3_000, 0)
    add("comm", arrive, done, AXIS_CODE["dp"], OP_CODE["all_reduce"], dp_group, step, 1 << 28, dp)
    add("compute", done, done + 30_000)
    add("optimizer", done + 30_000, done + 35_000)
    per = len(cols["kind"])
    row = np.repeat(np.arange(n), per)

    def stacked(key):
        return np.stack(cols[key], axis=1).reshape(-1)

    intervals = IntervalColumns.build(
        row=row,
        kind=stacked("kind"),
        start_us=stacked("start"),
        end_us=stacked("end"),
        axis=stacked("axis"),
        op=stacked("op"),
        group=stacked("group"),
        seq=stacked("seq"),
        size_bytes=stacked("bytes"),
        group_size=stacked("gsize"),
    )
    steps_cols = StepColumns.build(
        rank=rank, step=step, start_us=base, end_us=done + 35_000, coord=coord, node=rank // 8
    )
    return RecordTable(job="big", steps=steps_cols, intervals=intervals)


def test_16k_ranks_give_a_bounded_report_with_a_selection():
    table = big_job()
    bd = break_down(table)
    analysis = dp8_analysis(job="big")
    analysis["summary"]["slowest_rank"] = 1234
    analysis["findings"][0]["suspects"] = [{"rank": 9000, "node": "node-1125", "group": None}]
    analysis["rows"][2]["suspect"] = {"rank": 1234, "node": "node-154", "group": "dp:1", "message": "late"}
    doc = render_report(table, bd, analysis)
    assert len(doc.encode()) < 2_000_000
    parse(doc)
    assert "Showing 48 of 16,384 ranks" in doc
    assert "16,336 ranks left out" in doc
    for panel in panels(doc):
        rows = rows_of(panel)
        assert len(rows) == 48
        assert 1234 in rows  # the late rank: slowest and a suspect
        assert "slowest" in rows[1234]
        assert "suspect" in rows[1234]
        assert 9000 in rows  # a finding's suspect
        stages = {int(m) for chunk in rows.values() for m in re.findall(r"pp=(\d+)", chunk)}
        assert stages == set(range(8))  # a sample of every pipeline stage


def test_many_tiny_intervals_are_coalesced_per_pixel():
    """3,000 tp all-reduces of 0.5 µs per rank-step: far more than pixels, so the SVG must not grow with them."""
    table = big_job(tp=8, dp=4, pp=1, tp_calls=1000, late_rank=5)
    bd = break_down(table)
    doc = render_report(table, bd, dp8_analysis(job="tiny"))
    assert table.n_intervals > 60_000
    for panel in panels(doc):
        for chunk in rows_of(panel).values():
            assert len(re.findall("<rect", chunk)) < 40
    assert len(doc.encode()) < 300_000


def test_bad_arguments_are_refused():
    table, bd = dp8()
    other = read_table(PP2)
    with pytest.raises(ValueError, match="pass the breakdown of this table"):
        render_report(other, bd, dp8_analysis())
    with pytest.raises(ValueError, match="max_ranks = 0"):
        render_report(table, bd, dp8_analysis(), max_ranks=0)


def test_max_ranks_selects_fewer_rows():
    table, bd = dp8()
    doc = render_report(table, bd, dp8_analysis(), max_ranks=3)
    assert "Showing 3 of 8 ranks" in doc
    rows = rows_of(panels(doc)[0])
    assert 2 in rows  # slowest and suspect


# ---------------------------------------------------------------------------- files and the command line


def test_write_report(tmp_path: Path):
    table, bd = dp8()
    path = write_report(tmp_path / "r.html", table, bd, dp8_analysis())
    assert path.read_text(encoding="utf-8") == render_report(table, bd, dp8_analysis())


def test_cli_report_writes_html_and_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    out = tmp_path / "out"
    assert main(["report", str(PP2), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert str(out / "report.html") in printed
    assert str(out / "trace.json") in printed
    doc = (out / "report.html").read_text(encoding="utf-8")
    parse(doc)
    assert "pp2-tp2-dp2-straggler" in doc
    assert "Slowest step: step 2" in doc  # the straggler's step
    trace = json.loads((out / "trace.json").read_text(encoding="utf-8"))
    assert trace["otherData"]["steps"] == [0, 1, 2, 3]


def test_cli_report_missing_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    assert main(["report", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path)]) == 2
    assert "no such records file" in capsys.readouterr().err

"""Regenerate records.jsonl: python tests/data/pp2_tp2_dp2_straggler/make_records.py.

8 ranks, tp=2 dp=2 pp=2 (rank = tp + 2·dp + 4·pp), 2 micro-batches, a simple event-driven 1F1B-like schedule:
data wait, forward/backward per micro-batch with a tp all-reduce after each, pipeline send/recv between the stages
(over NVLink, 32 MiB), one dp all-reduce per step, optimizer. Nodes by dp index (node-0: dp=0, node-1: dp=1), so
the dp all-reduce crosses nodes and aligns the clocks; node-1's clock runs 2.5 ms ahead. Faults: rank 5 computes
1.6x slower in step 2 (a straggler); rank 3 waits 6 ms more for data in step 1. Collective ends are the last
arrival plus a fixed transfer, so every wait is exact: 4 steps, 32 records.

``analysis.json`` beside it is an ``Analysis.to_dict()`` for these records (``meshscope analyze --json`` output, with
its findings replaced by the hand-written ``straggler`` finding below): the report tests' input, so that they do not
depend on the analysis code's wording. This script writes both files; tests/core/test_fixtures.py fails when either
differs from what it would write today (regenerate with the command above and review the diff).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from meshscope.analysis import analyze
from meshscope.records import DataStats, Interval, StepRecord, read_table, write_records
from meshscope.topology.layout import RankCoord

TP, DP, PP, MB = 2, 2, 2, 2
FORWARD_US, TP_AR_US, P2P_US, DP_AR_US, OPT_US = 4000, 300, 400, 2500, 1200
STEPS, STRAGGLER, SLOW_STEP, SLOWDOWN = 4, 5, 2, 1.6
STARVED, STARVED_STEP, STARVED_US = 3, 1, 6000
SKEW_US = 2500
T0 = 1_700_000_000_000_000


def collective(cur, ivs, seq, members, axis, group, xfer, size):
    """All members leave at the last arrival plus ``xfer`` µs."""
    last = max(cur[r] for r in members)
    s = seq.get(group, 0)
    seq[group] = s + 1
    for r in members:
        kw = {"axis": axis, "op": "all_reduce", "group": group, "seq": s, "size_bytes": size}
        ivs[r].append(("comm", cur[r], last + xfer, {**kw, "group_size": len(members)}))
        cur[r] = last + xfer


def records() -> list[StepRecord]:  # noqa: C901 - a schedule, step by step
    ranks = range(TP * DP * PP)
    coord = {r: (r % TP, (r // TP) % DP, r // (TP * DP)) for r in ranks}
    rank_of = {c: r for r, c in coord.items()}
    seq: dict[str, int] = {}
    out = []
    t_step = T0
    for step in range(STEPS):
        cur = dict.fromkeys(ranks, t_step)
        ivs: dict[int, list[tuple[str, int, int, dict]]] = {r: [] for r in ranks}
        for r in ranks:
            d = 600 + 150 * r + (STARVED_US if (r, step) == (STARVED, STARVED_STEP) else 0)
            ivs[r].append(("data", cur[r], cur[r] + d, {}))
            cur[r] += d

        ready: dict[tuple[int, str, int], int] = {}
        for phase, stages, dur in (
            ("forward", range(PP), FORWARD_US),
            ("backward", range(PP - 1, -1, -1), 2 * FORWARD_US),
        ):
            for m in range(MB):
                for p in stages:
                    for d in range(DP):
                        group = [rank_of[(t, d, p)] for t in range(TP)]
                        src = p - 1 if phase == "forward" else p + 1
                        dst = p + 1 if phase == "forward" else p - 1
                        for r in group:
                            if 0 <= src < PP:
                                peer = rank_of[(coord[r][0], d, src)]
                                end = max(cur[r], ready[(peer, phase, m)]) + P2P_US
                                ivs[r].append(
                                    (
                                        "p2p",
                                        cur[r],
                                        end,
                                        {"axis": "pp", "op": "recv", "peer": peer, "size_bytes": 32 << 20},
                                    )
                                )
                                cur[r] = end
                            c = int(dur * (SLOWDOWN if (r, step) == (STRAGGLER, SLOW_STEP) else 1.0))
                            ivs[r].append(("compute", cur[r], cur[r] + c, {"phase": phase}))
                            cur[r] += c
                        collective(cur, ivs, seq, group, "tp", f"tp:{p}.{d}", TP_AR_US, 16 << 20)
                        for r in group:
                            if 0 <= dst < PP:
                                peer = rank_of[(coord[r][0], d, dst)]
                                ivs[r].append(
                                    (
                                        "p2p",
                                        cur[r],
                                        cur[r] + P2P_US,
                                        {"axis": "pp", "op": "send", "peer": peer, "size_bytes": 32 << 20},
                                    )
                                )
                                ready[(r, phase, m)] = cur[r]
                                cur[r] += P2P_US
        for p in range(PP):
            for t in range(TP):
                collective(
                    cur, ivs, seq, [rank_of[(t, d, p)] for d in range(DP)], "dp", f"dp:{p}.{t}", DP_AR_US, 256 << 20
                )
        for r in ranks:
            ivs[r].append(("optimizer", cur[r], cur[r] + OPT_US, {}))
            cur[r] += OPT_US
        for r in ranks:
            skew = SKEW_US if coord[r][1] == 1 else 0
            out.append(
                StepRecord(
                    job="pp2-tp2-dp2-straggler",
                    step=step,
                    rank=r,
                    coord=RankCoord(tp=coord[r][0], dp=coord[r][1], pp=coord[r][2], cp=0, ep=0),
                    node=f"node-{coord[r][1]}",
                    nvlink_domain=f"nvl-{coord[r][1]}",
                    gpu=coord[r][0] + 2 * coord[r][2],
                    start_us=t_step + skew,
                    end_us=cur[r] + skew,
                    intervals=tuple(
                        Interval(kind=k, start_us=a + skew, end_us=b + skew, **kw) for k, a, b, kw in ivs[r]
                    ),
                    stats=DataStats(tokens=16384, peak_memory_bytes=(60 + 8 * coord[r][2]) << 30),
                    gpu_util=0.97,
                )
            )
        t_step = max(cur.values()) + 200
    return out


HAND_FINDINGS: list[dict[str, Any]] = [
    {
        "code": "straggler",
        "severity": "warning",
        "message": (
            "rank 5 on node-0 computes 1.6x slower in step 2: its tp group tp:1.0 and, through the pipeline, every "
            "dp group wait for it"
        ),
        "evidence": {"rank": 5, "phase_seconds": 0.0384, "peer_median_seconds": 0.024, "share_of_step": 0.12},
        "suspects": [{"rank": 5, "node": "node-0", "group": "tp:1.0"}],
    }
]
"""The one finding the report tests show: 38.4 ms = 1.6 x 24 ms of compute (2 micro-batches x (4 + 8) ms)."""


def analysis(records_path: Path) -> dict[str, Any]:
    """``analyze``'s ``to_dict()`` of the records at ``records_path`` (JSON types), findings by hand."""
    out = json.loads(json.dumps(analyze(read_table(records_path)).to_dict()))
    out["findings"] = HAND_FINDINGS
    return out


def analysis_text(records_path: Path) -> str:
    """``analysis.json`` as written: one-space indents, UTF-8 (``µs`` as is), a final newline."""
    return json.dumps(analysis(records_path), indent=1, ensure_ascii=False) + "\n"


if __name__ == "__main__":
    here = Path(__file__).parent
    write_records(here / "records.jsonl", records())
    (here / "analysis.json").write_text(analysis_text(here / "records.jsonl"), encoding="utf-8")

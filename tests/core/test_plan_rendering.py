"""``meshscope plan FILE``'s text (``meshscope.plan.rendering``): every section, header, row and unit, line by line.

Two kinds of expectation, neither read back from the renderer:

- a small synthetic plan (the JSON form ``render_plan`` reads) whose whole text is written out by hand below, every
  width counted, so spacing, order and separators are pinned;
- real plans of the example manifests, whose tables are rebuilt here from the ``Plan`` object's own fields (not its
  ``to_dict()``), each number formatted as ``meshscope.formatting`` formats it, laid out by the rule the text follows
  (first column left-aligned, the rest right-aligned, two spaces between; the findings' last column unpadded).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from meshscope.formatting import human_bytes, human_count, human_seconds, human_si, percent
from meshscope.jobs.loading import load_spec
from meshscope.plan import Plan, PlanAssumptions, plan_job, render_plan, render_plan_report

if TYPE_CHECKING:
    from meshscope.jobs.spec import JobSpec

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
GiB, MiB = 1024**3, 1024**2

COLLECTIVES_TITLE = "Collectives per step (per GPU; FLOPs/byte below the link budget cannot be hidden)"
MEMORY_HEADERS = [
    "stage",
    "layers",
    "params/GPU",
    "weights",
    "gradients",
    "optimizer",
    "activations",
    "total",
    "headroom",
]
COLLECTIVE_HEADERS = [
    "axis",
    "collective",
    "message",
    "count/step",
    "bytes/GPU/step",
    "link",
    "FLOPs/byte",
    "budget",
    "exposed",
    "what",
]
CLASS_HEADERS = ["class", "seconds/step", "FLOPs/step", "HBM bytes/step", "efficiency"]
SEVERITY_TEXT = {"error": "ERROR", "warning": "WARNING", "info": "INFO"}


# ---------------------------------------------------------------------------------------------------- synthetic


def synthetic() -> dict[str, Any]:
    """A plan's JSON form, small enough to lay out by hand: two findings, one stage, one collective, every category."""
    return {
        "findings": [
            {"code": "memory-over-hbm", "severity": "error", "message": "stage 0 needs 90.0 GiB of 80.0 GiB"},
            {"code": "pp-over-network", "severity": "info", "message": "pp sends cross the network"},
        ],
        "stages": [
            {
                "pp_rank": 0,
                "layers": 2,
                "params": 1_500_000,
                "memory_bytes": {
                    "weights": 3 * GiB,
                    "gradients": 1536,
                    "optimizer": 0,
                    "activations": 512,
                    "total": 3 * GiB + 2048,
                },
                "headroom_bytes": 5 * MiB,
            }
        ],
        "collectives": [
            {
                "axis": "dp",
                "op": "all-reduce",
                "message_bytes": 2 * MiB,
                "count_per_step": 1234,
                "bytes_per_gpu_per_step": 3 * MiB,
                "link": "network",
                "flops_per_byte": 1234.6,
                "link_budget_flops_per_byte": 19780.0,
                "exposed_seconds_per_step": 0.25,
                "purpose": "gradients",
            }
        ],
        "expected_step_seconds": {
            "compute": 1.5,
            "exposed_comm": {"tp": 0.25, "dp": 0.1},  # not in axis order: the text sorts them
            "sync_wait": {"tp": 0.03, "dp": 0.02},
            "bubble": 0.0,
            "optimizer": 0.04,
            "data": 0.01,
            "other": 0.05,
            "total": 2.0,
            "pp_rank": 0,
        },
        "compute_model": "roofline per operation class",
        "compute_classes": [
            {
                "op": "mlp_up",
                "seconds_per_step": 1.0,
                "flops_per_step": 4.5e14,
                "bytes_per_step": GiB,
                "efficiency": 0.5,
            },
            {
                "op": "elementwise",
                "seconds_per_step": 0.5,
                "flops_per_step": 0.0,
                "bytes_per_step": 2048,
                "efficiency": None,
            },
        ],
        "flops_per_step": 9.0e17,
        "bubble_fraction": 0.0,
    }


# Laid out by hand: widths are the longest of header and cells (1.50 KiB, 250.00 ms, other (host overhead), ...).
SYNTHETIC_FINDINGS = [
    "Findings (2)",
    "severity  finding          evidence",
    "ERROR     memory-over-hbm  stage 0 needs 90.0 GiB of 80.0 GiB",
    "INFO      pp-over-network  pp sends cross the network",
]
SYNTHETIC_MEMORY = [
    "Memory per GPU, per pipeline stage",
    "stage  layers  params/GPU   weights  gradients  optimizer  activations     total  headroom",
    "-----  ------  ----------  --------  ---------  ---------  -----------  --------  --------",
    "0           2      1.50 M  3.00 GiB   1.50 KiB        0 B        512 B  3.00 GiB  5.00 MiB",
]
SYNTHETIC_COLLECTIVES = [
    COLLECTIVES_TITLE,
    "axis  collective   message  count/step  bytes/GPU/step     link  FLOPs/byte  budget    exposed       what",
    "----  ----------  --------  ----------  --------------  -------  ----------  ------  ---------  ---------",
    "dp    all-reduce  2.00 MiB       1,234        3.00 MiB  network       1,235  19,780  250.00 ms  gradients",
]
SYNTHETIC_STEP = [
    "Expected step time",
    "category                expected    share",
    "---------------------  ---------  -------",
    "compute                   1.50 s   75.0 %",
    "exposed comm dp        100.00 ms    5.0 %",
    "exposed comm tp        250.00 ms   12.5 %",
    "sync wait dp            20.00 ms    1.0 %",
    "sync wait tp            30.00 ms    1.5 %",
    "pipeline bubble              0 s    0.0 %",
    "optimizer               40.00 ms    2.0 %",
    "data wait               10.00 ms    0.5 %",
    "other (host overhead)   50.00 ms    2.5 %",
    "total                     2.00 s  100.0 %",
]
SYNTHETIC_CLASSES = [
    "Compute per operation class, stage 0 (roofline per operation class; efficiency = FLOPs ÷ (seconds x dense peak))",
    "class        seconds/step    FLOPs/step  HBM bytes/step   efficiency",
    "-----------  ------------  ------------  --------------  -----------",
    "mlp_up             1.00 s  450.00 TFLOP        1.00 GiB       50.0 %",
    "elementwise     500.00 ms        0 FLOP        2.00 KiB  bytes-bound",
]
SYNTHETIC_FLOPS = (
    "FLOPs per step: 900.00 PFLOP (model FLOPs, causal attention halved); pipeline bubble: 0.0 % of ideal compute"
)


def test_synthetic_plan_text_is_exactly_the_hand_laid_out_tables():
    blocks = [SYNTHETIC_FINDINGS, SYNTHETIC_MEMORY, SYNTHETIC_COLLECTIVES, SYNTHETIC_STEP, SYNTHETIC_CLASSES]
    expected = "".join("\n" + "\n".join(block) + "\n" for block in blocks) + "\n" + SYNTHETIC_FLOPS
    assert render_plan(synthetic()) == expected


def test_no_findings_is_one_line_before_the_memory_table():
    data = synthetic()
    data["findings"] = []
    text = render_plan(data)
    assert text.startswith("\nFindings: none\n\nMemory per GPU, per pipeline stage\n")
    assert "severity" not in text


def test_a_plan_form_without_the_optional_keys_falls_back_to_their_defaults():
    """No headroom, no compute model, no sync wait, data or host overhead: 0 B, "roofline", and no such rows."""
    data = synthetic()
    del data["stages"][0]["headroom_bytes"]
    del data["compute_model"]
    step = data["expected_step_seconds"]
    for key in ("sync_wait", "data", "other"):
        del step[key]
    lines = render_plan(data).split("\n")
    assert "0           2      1.50 M  3.00 GiB   1.50 KiB        0 B        512 B  3.00 GiB       0 B" in lines
    assert "Compute per operation class, stage 0 (roofline; efficiency = FLOPs ÷ (seconds x dense peak))" in lines
    start = lines.index("Expected step time")
    assert lines[start : start + 9] == [
        "Expected step time",
        "category          expected    share",
        "---------------  ---------  -------",
        "compute             1.50 s   75.0 %",
        "exposed comm dp  100.00 ms    5.0 %",
        "exposed comm tp  250.00 ms   12.5 %",
        "pipeline bubble        0 s    0.0 %",
        "optimizer         40.00 ms    2.0 %",
        "total               2.00 s  100.0 %",
    ]
    assert lines[start + 9] == ""


def test_calibrated_data_and_host_time_of_zero_print_no_rows():
    data = synthetic()
    step = data["expected_step_seconds"]
    step["data"] = step["other"] = 0.0
    step["sync_wait"] = {}
    lines = render_plan(data).split("\n")
    assert not [line for line in lines if line.startswith(("sync wait", "data wait", "other (host"))]
    assert "optimizer         40.00 ms    2.0 %" in lines


@pytest.mark.parametrize("classes", [None, []], ids=["absent", "empty"])
def test_without_compute_classes_the_flops_line_follows_the_step_time(classes: list[Any] | None):
    data = synthetic()
    if classes is None:
        del data["compute_classes"]
    else:
        data["compute_classes"] = classes
    text = render_plan(data)
    assert "Compute per operation class" not in text
    assert text.endswith("\n" + "\n".join(SYNTHETIC_STEP) + "\n\n" + SYNTHETIC_FLOPS)


def test_a_findings_header_wider_than_its_cells_sets_the_column():
    """One WARNING (7 characters) under "severity" (8): the column is 8 wide, header and row alike."""
    data = synthetic()
    data["findings"] = [{"code": "bubble-large", "severity": "warning", "message": "bubble is 37.5% of compute"}]
    text = render_plan(data)
    assert text.startswith(
        "\nFindings (1)\n"
        "severity  finding       evidence\n"
        "WARNING   bubble-large  bubble is 37.5% of compute\n"
        "\nMemory per GPU"
    )


# ---------------------------------------------------------------------------------------------------- real plans


def aligned(headers: list[str], rows: list[list[str]]) -> list[str]:
    """Header, dashes and rows: first column left-aligned, the rest right-aligned, two spaces between."""
    widths = [max(len(cell) for cell in column) for column in zip(headers, *rows, strict=True)]

    def line(cells: list[str]) -> str:
        first, *rest = cells
        padded = [first.ljust(widths[0]), *(c.rjust(w) for c, w in zip(rest, widths[1:], strict=True))]
        return "  ".join(padded).rstrip()

    return [line(headers), "  ".join("-" * w for w in widths), *(line(r) for r in rows)]


def left_aligned(headers: list[str], rows: list[list[str]]) -> list[str]:
    """The findings' layout: every column but the last padded on the right, the last as it is; no dashes."""
    widths = [max(len(cell) for cell in column) for column in zip(headers[:-1], *(r[:-1] for r in rows), strict=True)]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(cells[:-1], widths, strict=True)) + "  " + cells[-1]

    return [line(headers), *(line(r) for r in rows)]


CASES = {
    "llama3-8b-h100": ("llama3-8b-h100.yaml", None),
    "bad-tp16-h100": ("bad-tp16-h100.yaml", None),
    "mixtral-8x7b-pp4-ep8": ("mixtral-8x7b-h100.yaml", None),
    "llama3-8b-calibrated": (
        "llama3-8b-h100.yaml",
        PlanAssumptions(data_wait_seconds=0.012, host_overhead_seconds=0.034, sync_wait_per_collective_seconds=2e-5),
    ),
    "llama3-8b-flat": ("llama3-8b-h100.yaml", PlanAssumptions(compute_efficiency=0.5)),
}


@pytest.fixture(params=list(CASES), ids=list(CASES))
def planned(request: pytest.FixtureRequest) -> tuple[JobSpec, Plan, str]:
    manifest, assumptions = CASES[request.param]
    spec = load_spec(EXAMPLES / manifest)
    plan = plan_job(spec, assumptions=assumptions)
    return spec, plan, render_plan_report(spec, plan)


def sections(text: str) -> list[list[str]]:
    """The text's blank-line-separated blocks, each as its lines."""
    return [block.split("\n") for block in text.split("\n\n")]


def section(text: str, title: str) -> list[str]:
    found = [block for block in sections(text) if block[0] == title]
    assert len(found) == 1, [block[0] for block in sections(text)]
    return found[0][1:]


def findings_title(plan: Plan) -> str:
    return f"Findings ({len(plan.findings)})" if plan.findings else "Findings: none"


def classes_title(plan: Plan) -> str:
    model = "flat" if plan.assumptions.flat_compute else "roofline per operation class"
    return (
        f"Compute per operation class, stage {plan.expected_step_time.pp_rank} ({model}; "
        "efficiency = FLOPs ÷ (seconds x dense peak))"
    )


def test_report_is_a_header_line_then_the_sections_in_order(planned: tuple[JobSpec, Plan, str]):
    spec, plan, text = planned
    hw = spec.hardware
    header = (
        f"meshscope plan: {spec.name} — {spec.model.name} ({human_count(plan.total_params)} params) on "
        f"{hw.nodes * hw.gpus_per_node} x {hw.gpu.name} ({hw.nodes} nodes x {hw.gpus_per_node} GPUs), "
        f"{spec.layout.describe()}"
    )
    flops = (
        f"FLOPs per step: {human_si(plan.flops.model_flops, 'FLOP')} (model FLOPs, causal attention halved); "
        f"pipeline bubble: {percent(plan.bubble_fraction)} of ideal compute"
    )
    blocks = sections(text)
    assert blocks[0] == [header]
    assert [block[0] for block in blocks[1:]] == [
        findings_title(plan),
        "Memory per GPU, per pipeline stage",
        COLLECTIVES_TITLE,
        "Expected step time",
        classes_title(plan),
        flops,
    ]
    assert len(blocks[-1]) == 1


def test_header_of_the_llama3_8b_example():
    """Llama 3 8B has 8,030,261,248 parameters; the manifest asks for 8 nodes of 8 H100, tp=2, dp the rest (32)."""
    spec = load_spec(EXAMPLES / "llama3-8b-h100.yaml")
    first = render_plan_report(spec, plan_job(spec)).split("\n")[:3]
    assert first == [
        (
            "meshscope plan: llama3-8b-h100 — llama3-8b (8.03 B params) on 64 x H100 (8 nodes x 8 GPUs), "
            "dp=32 tp=2 pp=1 cp=1 ep=1 vpp=1"
        ),
        "",
        "Findings: none",
    ]


def test_findings_table_lists_severity_code_and_message(planned: tuple[JobSpec, Plan, str]):
    _, plan, text = planned
    block = next(b for b in sections(text) if b[0].startswith("Findings"))
    if not plan.findings:
        assert block == ["Findings: none"]
        return
    rows = [[SEVERITY_TEXT[f.severity.value], f.code, f.message] for f in plan.findings]
    assert block[1:] == left_aligned(["severity", "finding", "evidence"], rows)


def test_memory_table_has_one_row_per_stage(planned: tuple[JobSpec, Plan, str]):
    _, plan, text = planned
    rows = [
        [
            str(stage.pp_rank),
            str(sum(stop - start for start, stop in stage.layer_ranges)),
            human_count(stage.params.total),
            human_bytes(stage.memory.weights_bytes),
            human_bytes(stage.memory.gradients_bytes),
            human_bytes(stage.memory.optimizer_bytes),
            human_bytes(stage.memory.activations_bytes),
            human_bytes(stage.memory.total_bytes),
            human_bytes(stage.hbm_bytes - stage.memory.total_bytes),
        ]
        for stage in plan.stages
    ]
    assert [row[0] for row in rows] == [str(p) for p in range(plan.layout.pp)]
    assert section(text, "Memory per GPU, per pipeline stage") == aligned(MEMORY_HEADERS, rows)


def test_collectives_table_has_one_row_per_collective(planned: tuple[JobSpec, Plan, str]):
    _, plan, text = planned
    rows = [
        [
            c.axis,
            c.op.value,
            human_bytes(c.message_bytes),
            f"{c.count_per_step:,}",
            human_bytes(c.bytes_per_gpu_per_step),
            c.link.value,
            f"{c.flops_per_byte:,.0f}",
            f"{c.link_budget_flops_per_byte:,.0f}",
            human_seconds(c.exposed_seconds_per_step),
            c.purpose,
        ]
        for c in plan.collectives
    ]
    assert rows
    assert section(text, COLLECTIVES_TITLE) == aligned(COLLECTIVE_HEADERS, rows)


def test_step_time_table_lists_every_category_and_its_share(planned: tuple[JobSpec, Plan, str]):
    _, plan, text = planned
    t = plan.expected_step_time
    total = t.total_seconds

    def row(label: str, seconds: float) -> list[str]:
        return [label, human_seconds(seconds), percent(seconds / total)]

    rows = [row("compute", t.compute_seconds)]
    rows += [row(f"exposed comm {axis}", s) for axis, s in sorted(t.exposed_comm_seconds.items())]
    rows += [row(f"sync wait {axis}", s) for axis, s in sorted((t.sync_wait_seconds or {}).items())]
    rows += [row("pipeline bubble", t.bubble_seconds), row("optimizer", t.optimizer_seconds)]
    if t.data_seconds:
        rows.append(row("data wait", t.data_seconds))
    if t.other_seconds:
        rows.append(row("other (host overhead)", t.other_seconds))
    rows.append(["total", human_seconds(total), "100.0 %"])
    assert section(text, "Expected step time") == aligned(["category", "expected", "share"], rows)


def test_calibrated_assumptions_add_their_rows():
    """The calibrated case's extra categories are there: sync wait per axis, data wait and host overhead."""
    spec = load_spec(EXAMPLES / "llama3-8b-h100.yaml")
    _, assumptions = CASES["llama3-8b-calibrated"]
    plan = plan_job(spec, assumptions=assumptions)
    labels = [line[:21].rstrip() for line in section(render_plan_report(spec, plan), "Expected step time")[2:]]
    axes = sorted(plan.expected_step_time.exposed_comm_seconds)
    assert axes == ["dp", "tp"]
    assert labels == [
        "compute",
        "exposed comm dp",
        "exposed comm tp",
        "sync wait dp",
        "sync wait tp",
        "pipeline bubble",
        "optimizer",
        "data wait",
        "other (host overhead)",
        "total",
    ]


def test_compute_class_table_is_the_slowest_stages(planned: tuple[JobSpec, Plan, str]):
    _, plan, text = planned
    slowest = plan.stages[plan.expected_step_time.pp_rank]
    rows = [
        [
            c.op,
            human_seconds(c.seconds_per_step),
            human_si(c.flops_per_step, "FLOP"),
            human_bytes(c.bytes_per_step),
            "bytes-bound" if c.efficiency is None else percent(c.efficiency),
        ]
        for c in slowest.compute_classes
    ]
    assert rows
    assert section(text, classes_title(plan)) == aligned(CLASS_HEADERS, rows)


def test_rendering_reads_the_plan_without_changing_it():
    data = synthetic()
    before = copy.deepcopy(data)
    render_plan(data)
    assert data == before

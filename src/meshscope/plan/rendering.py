"""The plan for people: ``meshscope plan FILE``'s text, from the plan's JSON form.

Exists so that every command that shows a plan prints the same text: ``meshscope plan`` and ``kubectl meshscope
plan`` (the operator's kubectl plugin, which must not import the CLI). Every number carries its unit. It must not
compute anything the planner does not.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from meshscope.formatting import human_bytes, human_count, human_seconds, human_si, percent, render_table

if TYPE_CHECKING:
    from meshscope.jobs import JobSpec


class _Planned(Protocol):
    """What the text needs of a :class:`~meshscope.plan.Plan` (this module sits below the planner's)."""

    @property
    def total_params(self) -> int: ...

    def to_dict(self) -> dict[str, Any]: ...


def render_plan_report(spec: JobSpec, plan: _Planned) -> str:
    """``meshscope plan FILE``'s whole text: a header naming job, model, hardware and layout, then the tables."""
    header = (
        f"meshscope plan: {spec.name} — {spec.model.name} ({human_count(plan.total_params)} params) on "
        f"{spec.world_size} x {spec.hardware.gpu.name} ({spec.hardware.nodes} nodes x "
        f"{spec.hardware.gpus_per_node} GPUs), {spec.layout.describe()}"
    )
    return header + "\n" + render_plan(plan.to_dict())


def render_plan(data: dict[str, Any]) -> str:
    """The plan as readable tables, findings first."""
    out: list[str] = []
    findings = data["findings"]
    if findings:
        rows = [[f["severity"].upper(), f["code"], f["message"]] for f in findings]
        out.append(_render_left(["severity", "finding", "evidence"], rows, title=f"\nFindings ({len(findings)})"))
    else:
        out.append("\nFindings: none")

    rows = []
    for st in data["stages"]:
        mem = st["memory_bytes"]
        rows.append(
            [
                str(st["pp_rank"]),
                str(st["layers"]),
                human_count(st["params"]),
                human_bytes(mem["weights"]),
                human_bytes(mem["gradients"]),
                human_bytes(mem["optimizer"]),
                human_bytes(mem["activations"]),
                human_bytes(mem["total"]),
                human_bytes(st.get("headroom_bytes", 0)),
            ]
        )
    out.append(
        render_table(
            ["stage", "layers", "params/GPU", "weights", "gradients", "optimizer", "activations", "total", "headroom"],
            rows,
            title="\nMemory per GPU, per pipeline stage",
        )
    )

    rows = []
    for c in data["collectives"]:
        rows.append(
            [
                c["axis"],
                c["op"],
                human_bytes(c["message_bytes"]),
                f"{c['count_per_step']:,}",
                human_bytes(c["bytes_per_gpu_per_step"]),
                c["link"],
                f"{c['flops_per_byte']:,.0f}",
                f"{c['link_budget_flops_per_byte']:,.0f}",
                human_seconds(c["exposed_seconds_per_step"]),
                c["purpose"],
            ]
        )
    out.append(
        render_table(
            [
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
            ],
            rows,
            title="\nCollectives per step (per GPU; FLOPs/byte below the link budget cannot be hidden)",
        )
    )

    t = data["expected_step_seconds"]
    total = t["total"] or 1.0
    rows = [["compute", human_seconds(t["compute"]), percent(t["compute"] / total)]]
    rows += [
        [f"exposed comm {axis}", human_seconds(s), percent(s / total)] for axis, s in sorted(t["exposed_comm"].items())
    ]
    rows += [  # calibrated assumptions only (sync_wait_per_collective_seconds)
        [f"sync wait {axis}", human_seconds(s), percent(s / total)]
        for axis, s in sorted(t.get("sync_wait", {}).items())
    ]
    rows += [
        ["pipeline bubble", human_seconds(t["bubble"]), percent(t["bubble"] / total)],
        ["optimizer", human_seconds(t["optimizer"]), percent(t["optimizer"] / total)],
    ]
    rows += [  # calibrated assumptions only (data_wait_seconds, host_overhead_seconds)
        [label, human_seconds(t[key]), percent(t[key] / total)]
        for key, label in (("data", "data wait"), ("other", "other (host overhead)"))
        if t.get(key)
    ]
    rows += [["total", human_seconds(t["total"]), "100.0 %"]]
    out.append(render_table(["category", "expected", "share"], rows, title="\nExpected step time"))
    classes = data.get("compute_classes") or []
    if classes:
        rows = [
            [
                c["op"],
                human_seconds(c["seconds_per_step"]),
                human_si(c["flops_per_step"], "FLOP"),
                human_bytes(c["bytes_per_step"]),
                "bytes-bound" if c["efficiency"] is None else percent(c["efficiency"]),
            ]
            for c in classes
        ]
        title = (
            f"\nCompute per operation class, stage {t['pp_rank']} ({data.get('compute_model', 'roofline')}; "
            f"efficiency = FLOPs ÷ (seconds x dense peak))"
        )
        out.append(render_table(["class", "seconds/step", "FLOPs/step", "HBM bytes/step", "efficiency"], rows,
                                title=title))  # fmt: skip
    out.append(
        f"\nFLOPs per step: {human_si(data['flops_per_step'], 'FLOP')} (model FLOPs, causal attention halved); "
        f"pipeline bubble: {percent(data['bubble_fraction'])} of ideal compute"
    )
    return "\n".join(out)


def _render_left(headers: list[str], rows: list[list[str]], *, title: str) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers[:-1])]
    lines = [title, "  ".join(h.ljust(w) for h, w in zip(headers[:-1], widths, strict=True)) + "  " + headers[-1]]
    lines.extend("  ".join(c.ljust(w) for c, w in zip(r[:-1], widths, strict=True)) + "  " + r[-1] for r in rows)
    return "\n".join(lines)

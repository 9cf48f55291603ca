"""Prediction: the same job in another layout, planned with the assumptions its measured run calibrated.

Exists for ``meshscope predict``: a user who measured layout X asks what layout Y (or another GPU count, GPU,
micro-batch or recompute policy) will cost. :func:`retarget` builds Y's spec from X's; :func:`predict` plans it with
the calibrated assumptions of :mod:`meshscope.analysis.calibration` and lays the expected seconds per category beside
the measured run's, with the change per category and the memory check. Bad layouts get the planner's own errors.

Pure: no files (the command reads them), no simulation.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from meshscope.analysis.calibration import PRED_CATEGORIES, expected_categories
from meshscope.errors import PlanError
from meshscope.formatting import human_bytes, human_seconds, render_table
from meshscope.plan import (
    SYNC_WAIT_AXIS_FIELDS,
    cpu_contention,
    host_tokens_scale,
    host_tp_scale,
    micro_batch_tokens_per_rank,
    plan_job,
)
from meshscope.topology import default_hardware

if TYPE_CHECKING:
    from meshscope.analysis.calibration import Calibration, StepCategories
    from meshscope.jobs import JobSpec, Recompute
    from meshscope.plan import Plan
    from meshscope.topology import ParallelLayout


def category_label(category: str) -> str:
    """``comm.tp`` -> ``exposed comm tp``; the others as they are."""
    return f"exposed comm {category[5:]}" if category.startswith("comm.") else category


def retarget(
    spec: JobSpec,
    *,
    layout: ParallelLayout | None = None,
    gpus: int | None = None,
    hardware: str | None = None,
    micro_batch_size: int | None = None,
    recompute: Recompute | None = None,
) -> JobSpec:
    """``spec`` with another layout, GPU count, GPU type, micro-batch size or recompute policy (the rest kept).

    The hardware keeps its wiring and gets ``gpus ÷ gpus_per_node`` nodes (default: the layout's world size), or is
    the catalogue's ``hardware`` GPU. Fewer GPUs than a node are part of one node: they share its NVLink and nothing
    crosses the network. The global batch is kept, so a new dp or micro-batch changes the number of micro-batches
    (the planner says so when the batch does not split).

    Raises:
        PlanError: for a GPU count above one node that is not a whole number of nodes, naming both numbers.
        MeshscopeError: the catalogue's error for an unknown GPU.
    """
    new_layout = layout if layout is not None else spec.layout
    world = gpus if gpus is not None else new_layout.world_size
    if hardware is not None:
        hw = default_hardware(hardware, nodes=1)
        where = f"--hardware {hardware}"
    else:
        hw = spec.hardware
        where = "hardware.gpusPerNode in the spec"
    per_node = hw.gpus_per_node
    if world < 1:
        raise PlanError(f"--gpus must be >= 1, got {world}")
    if world < per_node:
        hw = replace(hw, nodes=1, gpus_per_node=world, nvlink_domain_gpus=world)
    elif world % per_node:
        given = f"--gpus {world}" if gpus is not None else f"layout {new_layout.describe()} ({world} GPUs)"
        raise PlanError(
            f"{given} is not a whole number of nodes of {per_node} GPUs ({where}): give a multiple of {per_node} "
            f"GPUs, or fewer than {per_node} for part of one node"
        )
    else:
        hw = replace(hw, nodes=world // per_node)
    training = spec.training
    if micro_batch_size is not None:
        training = replace(training, micro_batch_size=micro_batch_size)
    if recompute is not None:
        training = replace(training, recompute=recompute)
    return replace(spec, parallelism=replace(spec.parallelism, layout=new_layout), hardware=hw, training=training)


@dataclass(frozen=True, slots=True, kw_only=True)
class Prediction:
    """Layout Y's expected step beside the measured layout X's."""

    calibration: Calibration
    """The run that was measured and what it told."""
    spec: JobSpec
    """Y."""
    plan: Plan
    """Y planned with the calibrated assumptions."""

    @property
    def measured(self) -> StepCategories:
        """X's measured categories on the stage its calibrated plan says is slowest."""
        return self.calibration.critical

    def categories(self) -> dict[str, tuple[float, float]]:
        """Category -> (measured on X, expected on Y), seconds per step."""
        expected = expected_categories(self.plan)
        got = self.measured.seconds
        return {c: (got.get(c, 0.0), expected.get(c, 0.0)) for c in PRED_CATEGORIES}

    def not_calibrated(self) -> tuple[str, ...]:
        """Axes Y communicates on that the measured run had no collectives of: priced by the plan's model.

        Their sync wait is the base assumptions' (the run cannot tell it, and another axis' is not transferred);
        their transfer uses the fit of the link they cross, which the run's other collectives measured.
        """
        refused = {v.name for v in self.calibration.values if v.refused is not None}
        planned = {c.axis for c in self.plan.collectives if c.group != "pp"}
        return tuple(axis for axis, name in SYNC_WAIT_AXIS_FIELDS.items() if axis in planned and name in refused)

    @property
    def expected_step_seconds(self) -> float:
        """Y's expected step."""
        return self.plan.expected_step_time.total_seconds

    @property
    def fits(self) -> bool:
        """Whether every stage of Y fits in HBM."""
        return all(s.headroom_bytes >= 0 for s in self.plan.stages)

    def changes_text(self) -> str:
        """``exposed comm tp -0.31 s, bubble +0.07 s``: the categories that change, largest first."""
        deltas = [(c, e - m) for c, (m, e) in self.categories().items() if abs(e - m) > 0]
        deltas.sort(key=lambda d: -abs(d[1]))
        return ", ".join(f"{category_label(c)} {_signed(d)}" for c, d in deltas[:4]) or "no change"

    def to_dict(self) -> dict[str, Any]:
        """JSON form (base units)."""
        c = self.calibration
        return {
            "measured": {"job": c.spec.name, "layout": c.spec.layout.describe(), "pp_rank": self.measured.pp_rank,
                         "step_seconds": self.measured.total_seconds},
            "predicted": {"layout": self.spec.layout.describe(), "world_size": self.spec.world_size,
                          "gpu": self.spec.hardware.gpu.name, "micro_batch_size": self.spec.training.micro_batch_size,
                          "recompute": self.spec.training.recompute.value, "micro_batches": self.plan.micro_batches,
                          "pp_rank": self.plan.expected_step_time.pp_rank,
                          "step_seconds": self.expected_step_seconds},
            "categories": {
                k: {"measured_s": m, "expected_s": e, "change_s": e - m} for k, (m, e) in self.categories().items()
            },
            "memory": {
                "fits": self.fits,
                "stages": [
                    {"pp_rank": s.pp_rank, "peak_bytes": s.memory.total_bytes, "hbm_bytes": s.hbm_bytes,
                     "headroom_bytes": s.headroom_bytes}
                    for s in self.plan.stages
                ],
            },
            "findings": [f.to_dict() for f in self.plan.findings],
            "not_calibrated": list(self.not_calibrated()),
            "host_tokens_scale": None if (found := self.host_tokens()) is None else found[2],
            "host_tp_scale": None if (tp := self.host_tp()) is None else tp[2],
            "cpu_contention_extrapolated": None
            if (k := self.contention_extrapolated()) is None
            else {"measured": k[0], "target": k[1]},
            "calibrated_step_seconds": c.plan.expected_step_time.total_seconds,
            "assumptions": c.overrides,
        }  # fmt: skip

    def host_tokens(self) -> tuple[float, float, float] | None:
        """Where the target's micro-batch differs from the measured one's: how the host time per layer pass scales.

        Returns:
            (measured, predicted tokens per rank per micro-batch, the scale between them); ``None`` where the host
            time per layer pass was not calibrated or the tokens are the same.
        """
        a = self.calibration.assumptions
        if a.host_reference_tokens is None or a.host_seconds_per_layer_pass == 0.0:
            return None
        y = self.spec
        tokens = micro_batch_tokens_per_rank(y.model, y.training, y.layout)
        if tokens == a.host_reference_tokens:
            return None
        return a.host_reference_tokens, tokens, host_tokens_scale(a, tokens)

    def _host_tokens_line(self, found: tuple[float, float, float]) -> str:
        measured, tokens, scale = found
        a = self.calibration.assumptions
        return (
            f"host time per layer pass: {human_seconds(a.host_seconds_per_layer_pass)} measured at {measured:g} tokens "
            f"per micro-batch per rank, x {scale:.3g} at {tokens:g} (tokens ratio ** {a.host_tokens_exponent:.3g}: "
            "host_tokens_exponent, a testbed constant the run cannot fit)"
        )

    def host_tp(self) -> tuple[int, int, float] | None:
        """Where one of the measured and the target layout has tensor parallelism and the other not: the host scale.

        Returns:
            (measured, target tensor-parallel degree, the scale of the host time per layer pass between them);
            ``None`` where the host time per layer pass was not calibrated or the scale is 1.
        """
        a = self.calibration.assumptions
        if a.host_reference_tp is None or a.host_seconds_per_layer_pass == 0.0:
            return None
        tp = self.spec.layout.tp
        scale = host_tp_scale(a, tp)
        return None if scale == 1.0 else (int(a.host_reference_tp), tp, scale)

    def _host_tp_line(self, found: tuple[int, int, float]) -> str:
        measured, tp, scale = found
        a = self.calibration.assumptions
        return (
            f"host time per layer pass: measured at tp={measured}, x {scale:.3g} at tp={tp} (tensor parallelism's "
            f"dispatch: host_tp_factor {a.host_tp_factor:.3g}, a testbed constant the run cannot fit)"
        )

    def contention_extrapolated(self) -> tuple[float, float] | None:
        """Where the measured run had a core for every busy rank and the target shares them: (κ measured, κ target).

        The model stretches the host time, the collectives and their sync wait by the ratio of the two contentions
        (docs/predict.md, "CPU contention"); a run without contention cannot tell how gloo's transfers and waits grow
        once ranks are time-sliced (on the 2-core testbed, from κ 1 to 2: transfers x4.2 and sync wait x6.2 against
        the model's x2). ``None`` without a CPU testbed (``cpu_cores`` unset) or where the measured run was contended.
        """
        a = self.calibration.assumptions
        if a.cpu_cores is None or a.cpu_contention_at_fit > 1.0:
            return None
        kappa = cpu_contention(self.spec.world_size, self.plan.bubble_fraction, a.cpu_cores)
        return None if kappa <= 1.0 else (a.cpu_contention_at_fit, kappa)

    def _contention_line(self, found: tuple[float, float]) -> str:
        measured, target = found
        return (
            f"CPU contention extrapolated: the measured run had a core for every busy rank (κ {measured:.3g}), "
            f"the target shares them (κ {target:.3g}); the host time and the collectives are stretched by "
            f"{target / measured:.3g}, but a run without contention cannot tell how gloo's transfers and sync waits "
            "grow once ranks are time-sliced (on a 2-core machine they grew 4-6x from κ 1 to 2: docs/predict.md): "
            "expect its exposed communication under-predicted; calibrate from a contended run of the same cores"
        )

    def _not_calibrated_line(self) -> str:
        return (
            f"not calibrated: {', '.join(self.not_calibrated())}: the measured run had no such collectives, so their "
            "sync wait is the plan's model (the base assumptions), their transfer the fit of the link they cross"
        )

    def render(self) -> str:
        """For people: the table of categories, the change, the memory check, the findings."""
        c = self.calibration
        loose = {f"comm.{axis}" for axis in self.not_calibrated()}
        rows = [
            [category_label(k) + (" (not calibrated)" if k in loose else ""), human_seconds(m), human_seconds(e),
             _signed(e - m)]
            for k, (m, e) in self.categories().items()
            if m or e
        ]  # fmt: skip
        measured_total = self.measured.total_seconds
        rows.append(["step", human_seconds(measured_total), human_seconds(self.expected_step_seconds),
                     _signed(self.expected_step_seconds - measured_total)])  # fmt: skip
        y = self.spec
        out = [
            (
                f"meshscope predict: {c.spec.name} measured as {c.spec.layout.describe()} on {c.spec.world_size} x "
                f"{c.spec.hardware.gpu.name}; predicted as {y.layout.describe()} on {y.world_size} x "
                f"{y.hardware.gpu.name}, micro-batch {y.training.micro_batch_size} x {self.plan.micro_batches}, "
                f"recompute {y.training.recompute.value}"
            ),
            render_table(
                ["category", f"measured ({c.spec.layout.describe()})", f"expected ({y.layout.describe()})", "change"],
                rows,
                title=f"\nStep time per category (mean per step; measured stage {self.measured.pp_rank}, expected "
                f"stage {self.plan.expected_step_time.pp_rank}; exposed comm measured = transfer + sync wait)",
            ),
            f"\nchange: {self.changes_text()}",
            *([self._not_calibrated_line()] if self.not_calibrated() else []),
            *([self._host_tokens_line(found)] if (found := self.host_tokens()) is not None else []),
            *([self._host_tp_line(tp)] if (tp := self.host_tp()) is not None else []),
            *([self._contention_line(k)] if (k := self.contention_extrapolated()) is not None else []),
            (
                "calibration residual on the measured layout: calibrated plan "
                f"{human_seconds(c.plan.expected_step_time.total_seconds)} vs measured "
                f"{human_seconds(c.critical.total_seconds)} per step"
            ),
        ]
        worst = min(self.plan.stages, key=lambda s: s.headroom_bytes)
        verdict = "fits" if self.fits else "does NOT fit"
        out.append(
            f"memory: {verdict}: fullest stage {worst.pp_rank} peaks at {human_bytes(worst.memory.total_bytes)} of "
            f"{human_bytes(worst.hbm_bytes)} usable HBM (headroom {human_bytes(worst.headroom_bytes)})"
        )
        if self.plan.findings:
            out.append("findings:")
            out.extend(f"  {f.severity.value.upper()} {f.code}: {f.message}" for f in self.plan.findings)
        return "\n".join(out)


def _signed(seconds: float) -> str:
    text = human_seconds(abs(seconds))
    return ("+" if seconds >= 0 else "-") + text


def predict(calibration: Calibration, target: JobSpec) -> Prediction:
    """Plan ``target`` with ``calibration``'s assumptions.

    Raises:
        PlanError: the planner's errors for a layout, batch or hardware that does not fit.
    """
    plan = plan_job(target, assumptions=calibration.assumptions)
    return Prediction(calibration=calibration, spec=target, plan=plan)

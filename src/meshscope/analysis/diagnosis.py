"""Diagnosis: from a breakdown to findings that name the cause, the rank or node, and what it costs per step.

Exists because a cost table says *where* the time goes (e.g. dp sync wait) but not *why*: the same wait comes from a
slow GPU, from a batch with four times the attention work, or from a link that is slower through one node. Each
detector here reads the indexed breakdown (:class:`~meshscope.analysis.costs.RankSteps`), compares like with like (a
rank with the peers of its own pipeline stage in the same step, a transfer's time per byte with the transfers of the
same axis, op, group size and link) and fires only when the effect is both clearly above the run's own noise and worth
at least 1 % of the step. Every finding carries its numbers (``evidence``) and its suspects (rank, node, group).
Thresholds are the constants below, documented in ``docs/cost-table.md``; a clean run (noise only) gives no finding.

How causes are told apart:

* **straggler**: a rank's compute (or data wait, or optimizer) is long against its stage peers *with the same work*;
* **data-imbalance**: rank-steps whose compute is long *because* their batch carries more tokens / attention work;
* **slow-link**: **transfer** time per byte (after the last member arrived, so never sync wait) is higher on the
  transfers through one node's network (or inside one NVLink domain) than on the same transfers elsewhere;
* **placement**: an axis whose groups cross NVLink domains spends a real share of the step in exposed transfer;
* **between-steps**: a rank that spends much longer than its peers between two steps (eval, checkpoint, logging
  outside a step), which the others wait for in their next collective;
* **bubble-above-plan**, **data-loader-starved**, **checkpoint-stall**: job-wide categories above the plan or a share.

It is vectorised over rank-steps and collective instances (grouped medians by one sort, per-node sums by
``bincount``); loops run over phases, axes and the handful of candidates. It must not read files, print, or decide on
anything but the numbers it is given.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from meshscope.analysis.breakdown import (
    BUBBLE,
    CATEGORY_INDEX,
    CHECKPOINT,
    COMPUTE,
    DATA,
    OPTIMIZER,
    OTHER,
    TRANSFER,
    comm_category,
)
from meshscope.analysis.costs import (
    Suspect,
    Transfers,
    expected_pipeline,
    grouped_median,
    grouped_quantile,
    measure_transfers,
    own_time_us,
    place_of_rows,
    stage_expected,
    wait_caused,
)
from meshscope.analysis.grouping import distinct, median_of_others, median_rank_value
from meshscope.formatting import human_bytes, human_seconds, percent
from meshscope.plan import Severity
from meshscope.records import BETWEEN_KINDS, COMM_CODE, OPS, CommOp, Note
from meshscope.topology import AXES

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from numpy.typing import NDArray

    from meshscope.analysis.costs import RankSteps, WaitCaused
    from meshscope.jobs import JobSpec
    from meshscope.plan import Plan

# ---------------------------------------------------------------------------------------------- thresholds

MIN_COST_SHARE = 0.01
"""Every finding must cost at least this share of the median step time."""
NOISE_SIGMAS = 6.0
"""An outlier must stand this many robust standard deviations (1.4826 x MAD) above its peers."""
STRAGGLER_MIN_EXCESS = 0.05
"""A straggler's phase is at least this much longer than its stage peers' (relative)."""
CONTENDED_MIN_EXCESS = 0.25
"""On a run whose ranks outnumbered their CPU cores (the ``cpu_contention`` note), a persistent straggler's phase is
at least this much longer than the rest's: time-slicing alone made one of 4 ranks on 2 cores up to ~20 % slower in
compute over a whole clean run (benchmarks/bench_real_runs.py)."""
STRAGGLER_EXPLAINS = 0.5
"""A straggler's own phases explain at least this share of the sync wait it is charged with per waiting rank: its
excess over the rest of its stage in the phase named (amortised for a transient one), or summed over compute, data
loading, the optimizer step and its time outside them where each is longer. A rank last into its collectives by 5 ms
a step whose optimizer step took 0.9 ms longer than its peers' is last for another reason (a slow link on its way
there, time before its step, noise on a 2-rank run), and naming the phase would send the user after the wrong cause;
the cost table still names it as the rank its peers waited for."""
STRAGGLER_CONSISTENCY = 0.75
"""A persistent straggler is above the rest of its stage in at least this share of its steps ..."""
STRAGGLER_STEADY = 0.5
"""... by at least this share of its median excess: slow steadily, not a burst. On shared or virtual cores a rank
runs 10-45 % slower for a few steps at a time with no wait for a CPU to show for it (2 ranks on 2 cores, clean
nanoGPT-style runs of 10 steps: 4 in 118 had such a rank, whose median excess a burst of 5 slow steps and 4 steps
within 0.8 ms of its peer's made); counted merely "above", half the steps of a clean rank are."""
STEP_JITTER_SIGMAS = 1.5
"""A straggler or slow link must cost at least this many robust standard deviations of the run's own step-to-step
jitter (each step's median own time, i.e. step minus sync wait and bubble, over steps): on shared cores or a busy
host, ranks differ by milliseconds for no reason a user can act on; an effect smaller than the run's own noise is
not resolved."""
PERSISTENT_MIN_SHARE = 0.05
"""... or, for a persistent straggler, this share of the step and that many standard errors of its median cost (the
jitter ÷ √steps): slow in (nearly) every step, it is no noise, and at 5 % of every step (the warning severity) it is
worth chasing even on a run whose steps jitter more than it costs."""
STEADY_SIGMAS = 20.0
"""... or, for a persistent straggler on a run whose steps jitter more than that, its median excess stands this many
standard errors of its own steps' excess above the rest (the robust spread of its per-step excess ÷ √steps): a
Trainer rank reading every sample 20 ms slower from its disk, 78 ms a step in each of 9 steps against its peer's 1 ms
(52 standard errors), beside CPU burners whose contention made the steps range from 0.5 to 1.5 s (jitter 675 ms: the
bar 338 ms against its 181 ms) went unnamed (tests/data/trainer_slow_disk_burners); a rank slower only by the host's
noise moves with it from step to step and stays far under."""
MINORITY_TIE = 0.8
"""Suspects beyond the fewer-than-half of a stage that may be named: when the first left out is at least this x as
slow as the last kept, the stage splits into halves nobody can tell apart, and none is named."""
SLOWER_CORE_OPTIMIZER = 0.10
"""On a run without a GPU, a rank whose optimizer step takes ``r`` x its peers' in its median step, ``r - 1`` at least
this, runs on a slower core: its extra time on a CPU is the host's up to ``(r - 1)`` x its peers' time on a CPU
(``_core_slowdown``)."""
CONTENDED_MIN_SLOW_STEPS = 2
"""On a run whose timings include CPU contention, a transient straggler is slow in at least this many steps: one slow
step on a contended host is a scheduler hiccup on a random rank (a clean DDP-tutorial run, 4 ranks on 2 cores beside
two burners: rank 0 took 2x its peers' compute in one step of 11, 8 % of the step amortised, and was named)."""
TRANSIENT_MIN_SHARE = 0.03
"""A transient straggler (slow in some steps only) costs at least this share of the step, amortised: one slow step
in fifteen from a busy host is noise, not a rank to chase."""
PAIR_MIN_STRETCHES = 3
"""In a stage of two ranks, a transient straggler's slow steps fall in at least this many separate stretches (runs of
consecutive steps): with one peer there is no spread between ranks to stand out from, and a burst of consecutive slow
steps on one of two ranks is the host's (on shared cores one rank runs 10-45 % slower for a few tenths of a second:
tests/data/clean_nanogpt_burst), where slow steps that recur between normal ones are the rank's own periodic work
(an evaluation, a log flush, a checkpoint every N steps)."""
PAIR_TRANSIENT_MIN_SHARE = 0.06
"""... and stands out from its one peer by at least this share of the step, amortised: twice a larger stage's
:data:`TRANSIENT_MIN_SHARE`, the other rank being a yardstick of one. 36 clean 2-rank runs of the three test scripts
(quiet, beside one spinner, beside two; 2026-12-06) came to at most 0.57 x 3 %, in four stretches (rank 0 of the
nanoGPT-style loop, which prints a line every step)."""
JITTER_SIGMAS = 3.0
"""... by at least this many standard errors of a median over its steps (the robust standard deviation of the
rest's rank-steps around their median, ÷ √steps): thresholds follow the run's measured noise, not a fixed share."""
STRAGGLER_PHASES: tuple[str, ...] = (COMPUTE, DATA, OPTIMIZER, OTHER)
"""What a straggler can be slow in: its own time in a step. ``other`` is the step's time outside its phases and its
collectives (host work no phase covers: a metric, a log line, a host-device sync between ``forward`` and
``backward``); small on every rank of a clean run, and a rank that spends 50 ms a step there makes its groups wait as
surely as one that computes 50 ms longer (a DTensor/FSDP2 job whose rank 2 slept between its phases: the table
charged it the sync wait, and no straggler finding said why)."""
_PHASE_WORDS: dict[str, str] = {
    COMPUTE: "compute",
    DATA: "data loading",
    OPTIMIZER: "the optimizer step",
    OTHER: "its time outside phases and collectives (host work no phase covers)",
}
WORK_RATIO = 1.10
"""Work (attention work, tokens, longest sequence) at or above this x the peers' median counts as "more work"."""
IMBALANCE_MIN_EXCESS = 0.05
"""A rank-step of an imbalance computes at least this much longer than its stage peers in that step."""
PLACEMENT_MIN_SHARE = 0.03
"""Exposed transfer of an axis whose groups cross NVLink domains, as a share of the step."""
SLOW_STAGE_RATIO = 1.5
"""A pipeline stage is slow when its work per step (:data:`STAGE_WORK` of its slowest rank: a stage's pass ends with
its last rank) is at least this x the next slowest stage's, each over what the plan expects of it (with no plan,
over each other). The demo's pipeline in 25 runs of ``tests/e2e_local`` with no slow stage, beside two spinning
processes came to 1.00-1.15 x (1.17-1.39 x raw: its last stage computes the output layer and the loss); one rank of a
pp=2 run computing 3x as long to 2.7 x."""
SLOW_STAGE_MIN_SHARE = 0.05
"""... and the other stages' wait for it costs at least this share of the step."""
BUBBLE_MIN_RATIO = 1.5
"""Measured bubble at least this x the plan's ..."""
BUBBLE_MIN_SHARE = 0.03
"""... and above it by at least this share of the step."""
DATA_MIN_SHARE = 0.03
"""The median rank's data wait, as a share of the step."""
CHECKPOINT_MIN_SHARE = 0.03
"""Amortised checkpoint time, as a share of the step."""
SLOW_LINK_RATIO = 1.3
"""A transfer is slow at this x the time per byte of the fast end of its class."""
SLOW_LINK_TIE = 0.1
"""Nodes within this fraction of the suspect's count of slow transfers are named with it (they cannot be told
apart)."""
SLOW_LINK_BASE_QUANTILE = 0.2
"""The fast end of a class of transfers, the reference a slow transfer is compared with."""
SLOW_LINK_CONCENTRATION = 0.5
"""The suspect node (or domain) must take part in at least this share of the slow transfers ..."""
SLOW_LINK_CONSISTENCY = 0.5
"""... and at least this share of its own transfers (of the link kind: network or NVLink) must be slow."""
SLOW_LINK_PLAN_RATIO = 2.0
"""With a spec, transfers at least this x the plan's link model (bytes x bus factor ÷ bandwidth x efficiency)."""
SEVERITY_ERROR_SHARE = 0.20
"""A finding costing at least this share of the step is an error ..."""
SEVERITY_WARNING_SHARE = 0.05
"""... at least this share a warning, below it info."""
MAX_STRAGGLER_FINDINGS = 5
"""At most this many straggler findings (one per node, the costliest first)."""

WARM_UP = "warm_up"
"""The note of a first step read that looks like a warm-up (``meshscope.analysis.commands.warm_up_note``): no data
missing, a caveat on the figures, said at the top like :data:`CPU_CONTENTION`."""
CPU_CONTENTION = "cpu_contention"
"""Code of the note ``meshscope run`` adds when ranks outnumber the CPU cores they run on."""
CONTENTION_SAID = "timings include CPU contention"
"""What a timing finding of a contended run says, once."""
RUNQUEUE_CONTENTION_SHARE = 0.05
"""On a run without a GPU whose records carry the training threads' run delay (``runqueue_wait_us``): when the
median rank-step waited at least this share of its step for a CPU, the run was CPU-contended (foreign load, more
threads than cores) whatever ``meshscope run`` could see, and its findings say so as an oversubscribed run's do."""

_MAD_TO_SIGMA = 1.4826
_NON_PLACEMENT_AXES = frozenset({"dp", "pp"})
"""Axes whose traffic is expected to cross the network (gradient reduction, stage-to-stage)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Finding:
    """One diagnosed cause, with numbers."""

    code: str
    """``straggler``, ``data-imbalance``, ``between-steps``, ``placement``, ``bubble-above-plan``,
    ``data-loader-starved``, ``checkpoint-stall`` or ``slow-link``."""
    severity: Severity
    """From the cost share: error ≥ 20 %, warning ≥ 5 %, else info."""
    message: str
    """One or two sentences with the numbers and units."""
    evidence: Mapping[str, float | int | None]
    """The numbers behind the message, base units (seconds, bytes, ratios)."""
    suspects: tuple[Suspect, ...]
    """Who to look at, most suspect first."""
    cost_seconds_per_step: float = field(default=0.0)
    """What it costs every GPU per step (the sort key)."""

    def to_dict(self) -> dict[str, Any]:
        """``{code, severity, message, evidence, suspects: [{rank, node, group}]}``."""
        return {
            "code": self.code,
            "severity": self.severity.value,
            "message": self.message,
            "evidence": dict(self.evidence),
            "suspects": [s.to_dict(message=False) for s in self.suspects],
        }


def severity_for(share: float) -> Severity:
    """Severity of a finding costing ``share`` of the step."""
    if share >= SEVERITY_ERROR_SHARE:
        return Severity.ERROR
    if share >= SEVERITY_WARNING_SHARE:
        return Severity.WARNING
    return Severity.INFO


def diagnose(
    rs: RankSteps, *, plan: Plan | None = None, spec: JobSpec | None = None, notes: Sequence[Note] = ()
) -> tuple[Finding, ...]:
    """Every finding for the indexed breakdown ``rs``, most costly first.

    Args:
        rs: the indexed breakdown.
        plan: the plan (enables ``bubble-above-plan``, placement from the spec's placement, link efficiencies).
        spec: the job spec (link bandwidths: the plan's link model for slow links, the placement evidence).
        notes: the analysis' partial-data notes; a ``cpu_contention`` note (ranks outnumbered their cores) makes
            every timing finding say so.

    Returns:
        Findings sorted by cost per step, largest first; empty for a clean run.
    """
    ctx = _Context.build(rs, notes)
    transfers = measure_transfers(rs, spec=spec, plan=plan)
    findings: list[Finding] = []
    findings += _stragglers(ctx)
    findings += _imbalance(ctx)
    findings += _between_steps(ctx)
    findings += _slow_link(ctx, transfers)
    findings += _placement(ctx, plan=plan, spec=spec, transfers=transfers)
    findings += _data_starved(ctx)
    findings += _checkpoint(ctx)
    findings += _slow_stage(ctx, plan=plan, stragglers=findings)
    # last: a pipeline waits for every root cause above (a checkpoint on one stage holds up the others' receives)
    findings += _bubble(ctx, plan=plan, explained_seconds=sum(_delay_seconds(f) for f in findings))
    clause = ctx.contention_clause()
    if clause:
        findings = [
            replace(f, message=f.message + clause, evidence={**f.evidence, "cpu_contention": 1}) for f in findings
        ]
    return tuple(sorted(findings, key=lambda f: -f.cost_seconds_per_step))


# ---------------------------------------------------------------------------------------------- shared context


def runqueue_contention(rs: RankSteps) -> Note | None:
    """The ``cpu_contention`` note of a host-timed run whose training threads waited for a CPU, else ``None``.

    Measured from the records (``runqueue_wait_us``), so it holds wherever the run came from: foreign load beside a
    local run, a busy host in a cluster. Said when the median rank-step waited :data:`RUNQUEUE_CONTENTION_SHARE` of
    its step or more.
    """
    if not rs.breakdown.table.host_timed_with_runqueue:
        return None
    s = rs.breakdown.table.steps
    steps_us = np.maximum((s.end_us - s.start_us).astype(np.float64), 1.0)
    waited = float(np.median(s.runqueue_wait_us / steps_us))
    if waited < RUNQUEUE_CONTENTION_SHARE:
        return None
    return Note(
        code=CPU_CONTENTION,
        count=rs.n_ranks,
        message=(
            f"the training threads waited for a CPU {waited:.0%} of the median step (run-queue delay: other work "
            "on their cores); a rank's extra wait for a CPU is taken out of its time before it is called a straggler"
        ),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class _Context:
    rs: RankSteps
    step_us: float
    """Median step, µs."""
    peer_key: NDArray[np.int64]
    """(step, pipeline stage) group of each rank-step."""
    n_peer_groups: int
    work_ratio: NDArray[np.float64] | None
    """Per rank-step: its work ÷ its (step, stage) peers' median work; ``None`` when no work is measured."""
    work_name: str
    step_jitter_us: float = 0.0
    """Robust standard deviation over steps of each step's median own time (step minus sync wait and bubble), µs."""
    contention: Note | None = None
    """The run's ``cpu_contention`` note (ranks outnumbered the cores they ran on, or the training threads waited for
    a CPU :data:`RUNQUEUE_CONTENTION_SHARE` of their steps), if any."""
    host_excess_us: NDArray[np.float64] | None = None
    """Per rank-step of a run timed on the host (no GPU) whose every record has ``runqueue_wait_us``: how much its run
    delay (outside its compute, where the records say how much fell in it) exceeds the median of the others of its
    (step, stage) group (0 when it waited less), plus :attr:`core_excess_us`, µs; ``None`` otherwise
    (:func:`_host_excess_us`). Time the host took from one rank more than from its peers is the host's, not the
    job's: the straggler detector takes it out of the phase it compares (:meth:`phase_us`)."""
    core_excess_us: NDArray[np.float64] | None = None
    """Per rank-step of such a run: how much of its time on a CPU beyond its peers' its slower core explains, µs (0
    where its core is no slower, or the records lack ``on_cpu_us``)."""
    own_compute_us: NDArray[np.float64] | None = None
    """Per rank-step of such a run whose every record has ``compute_runqueue_wait_us`` (its run delay in its compute):
    its compute less that wait (:func:`_own_compute_us`), µs, compared so for every rank alike (:meth:`reference_us`);
    ``None`` otherwise."""
    phase_host_excess_us: dict[str, NDArray[np.float64]] = field(default_factory=dict)
    """Per phase (data loading, the optimizer step, the time outside phases) of such a run whose every record says how
    long the thread waited for a CPU in it (``data_runqueue_wait_us``, ``optimizer_runqueue_wait_us``; outside phases:
    the rest, :func:`_phase_runqueue_waits`): per rank-step, what the host took from that phase beyond its peers'
    (:func:`_phase_host_excess_us`), µs."""

    def contention_clause(self) -> str:
        """What every timing finding of a contended run must say."""
        if self.contention is None:
            return ""
        message = self.contention.message
        if CONTENTION_SAID in message:  # `meshscope run`'s notes say it already
            return f" ({message})"
        return f" ({CONTENTION_SAID}: {message})"

    @classmethod
    def build(cls, rs: RankSteps, notes: Sequence[Note] = ()) -> _Context:
        s = rs.breakdown.table.steps
        pp = s.coord[:, AXES.index("pp")]
        stages = int(pp.max()) + 1
        key = rs.step_index.astype(np.int64) * stages + pp
        n_groups = rs.n_steps * stages
        work_ratio, work_name = None, ""
        measures: list[tuple[str, NDArray[np.float64]]] = [
            ("attention work", s.attention_work),
            ("tokens", s.tokens.astype(np.float64)),
            ("longest sequence", s.longest_sequence.astype(np.float64)),
        ]
        routed = routed_bytes(rs)
        if routed is not None:
            measures.append((ROUTED, routed))
        for name, column in measures:
            known = np.isfinite(column) & (column >= 0)
            if known.all() and column.size:
                peers = grouped_median(key, column, n_groups)[key]
                with np.errstate(invalid="ignore", divide="ignore"):
                    ratio = np.where(peers > 0, column / peers, 1.0)
                work_ratio = ratio if work_ratio is None else np.maximum(work_ratio, ratio)
                work_name = work_name or name
        contention = next((n for n in notes if n.code == CPU_CONTENTION), None) or runqueue_contention(rs)
        excess = core = own_compute = None
        by_phase: dict[str, NDArray[np.float64]] = {}
        if rs.breakdown.table.host_timed_with_runqueue:
            waits = _phase_runqueue_waits(rs)
            if COMPUTE in waits:
                own_compute = _own_compute_us(rs, waits[COMPUTE])
            excess, core, slowdown = _host_excess_us(rs, key, n_groups, waits)
            by_phase = {
                phase: _phase_host_excess_us(rs, key, n_groups, phase, waits[phase], core=core, slowdown=slowdown)
                for phase in (DATA, OPTIMIZER, OTHER)
                if phase in waits
            }
            if OTHER in by_phase:  # where a checkpoint phase took time too, the records do not split the rest
                by_phase[OTHER] = np.where(rs.us(CHECKPOINT) > 0, excess, by_phase[OTHER])
        return cls(
            rs=rs,
            step_us=rs.median_step_us,
            peer_key=key,
            n_peer_groups=n_groups,
            work_ratio=work_ratio,
            work_name=work_name,
            step_jitter_us=_step_jitter_us(rs),
            contention=contention,
            host_excess_us=excess,
            core_excess_us=core,
            own_compute_us=own_compute,
            phase_host_excess_us=by_phase,
        )

    def phase_us(self, phase: str) -> NDArray[np.float64]:
        """A phase's µs per rank-step as the straggler detector holds a rank to: less the host's excess, if known.

        Compute, where the records say how long each rank waited for a CPU in it (:attr:`own_compute_us`): less
        that wait, as its peers' (:meth:`reference_us`), and less what its slower core explains
        (:attr:`core_excess_us`). Data loading, the optimizer step and the time outside phases, where the records
        say how long each rank waited for a CPU in them: less what the host took there
        (:attr:`phase_host_excess_us`). Any other phase, and
        those without that: less the host's excess (:attr:`host_excess_us`) whole, at most down to 0: the records
        do not say in which of them the thread waited for a CPU (or ran slower on one), so this is the least the
        rank's own work can have taken. Its peers are compared as measured there, the most theirs can have taken:
        a rank is named only where it is slower than the peers on both bounds. Taking the excess out of the peers
        too made a peer that waited for a core in its compute look faster in its optimizer step, and its partner a
        straggler there.
        """
        values = self.rs.us(phase)
        if self.host_excess_us is None:
            return values
        if phase == COMPUTE and self.own_compute_us is not None and self.core_excess_us is not None:
            return np.maximum(self.own_compute_us - self.core_excess_us, 0.0)
        took = self.phase_host_excess_us.get(phase, self.host_excess_us)
        return np.maximum(values - took, 0.0)

    def reference_us(self, phase: str) -> NDArray[np.float64]:
        """A phase's µs per rank-step as the peers a rank is compared with took it (:meth:`phase_us`).

        Compute less the time each waited for a CPU in it, where the records say (like for like: beside a spinning
        process, the rank sharing its core waited 15 ms a step in a compute of 28 ms, and a rank with twice its work
        on a CPU looked only 40 % slower, in fewer than 75 % of its steps); otherwise as measured.
        """
        if phase == COMPUTE and self.own_compute_us is not None:
            return self.own_compute_us
        return self.rs.us(phase)

    def peer_median(self, values: NDArray[np.float64]) -> NDArray[np.float64]:
        """Each rank-step's (step, stage) peers' median of ``values``."""
        return grouped_median(self.peer_key, values, self.n_peer_groups)[self.peer_key]

    def share(self, seconds: float) -> float:
        return seconds * 1e6 / self.step_us if self.step_us > 0 else 0.0

    def suspect(self, rank_index: int, *, group: str | None = None) -> Suspect:
        return Suspect(rank=int(self.rs.ranks[rank_index]), node=self.rs.node_name(rank_index), group=group)

    def where(self, rank_index: int) -> str:
        return f"rank {int(self.rs.ranks[rank_index])} on {self.rs.node_name(rank_index)}"


_PHASE_RUNQUEUE_COLUMNS = {
    COMPUTE: "compute_runqueue_wait_us",
    DATA: "data_runqueue_wait_us",
    OPTIMIZER: "optimizer_runqueue_wait_us",
}
"""The record fields that say how long a host-timed rank-step's thread waited for a CPU in a phase."""


def _phase_runqueue_waits(rs: RankSteps) -> dict[str, NDArray[np.float64]]:
    """Per phase whose run delay every record gives (:data:`_PHASE_RUNQUEUE_COLUMNS`): it per rank-step, µs.

    With all three, also the time outside them (``other``): the step's run delay less theirs, which holds the wake-ups
    of collectives outside phases too (so at least what ``other`` waited) and, in a step with checkpoint time, the
    checkpoint's wait (the caller leaves such rank-steps to the whole extra host time).
    """
    s = rs.breakdown.table.steps
    columns = {phase: getattr(s, name) for phase, name in _PHASE_RUNQUEUE_COLUMNS.items()}
    waits = {phase: col.astype(np.float64) for phase, col in columns.items() if bool((col >= 0).all())}
    if len(waits) == len(_PHASE_RUNQUEUE_COLUMNS):
        total = s.runqueue_wait_us.astype(np.float64)
        waits[OTHER] = np.maximum(total - waits[COMPUTE] - waits[DATA] - waits[OPTIMIZER], 0.0)
    return waits


def _host_excess_us(
    rs: RankSteps, key: NDArray[np.int64], n_groups: int, waits: dict[str, NDArray[np.float64]]
) -> tuple[NDArray[np.float64], NDArray[np.float64], NDArray[np.float64]]:
    """Per rank-step of a host-timed run: the time the host took from it beyond its (step, stage) peers', µs.

    Returns the whole of it, its slower core's part (below), and that core's slowdown (``r - 1``, 0 for a core no
    slower than its peers': :func:`_core_slowdown`). ``waits``: the run delay in each rank-step's phases, where the
    records say (:func:`_phase_runqueue_waits`): compute is compared less its own, so only the run delay outside
    compute counts here, and the optimizer step, the witness of a slower core, less its own.

    Its run delay beyond the median of its peers' (the others of its group: in a group of two, a median with itself
    in it would leave it half its own excess). Only a wait beyond the peers' is taken out: a rank the scheduler
    favoured is not made slower for it. All of it, not only the part beyond the peers' rate for the same work (the
    cost table's host share, chains.host_delay_us): a rank is named only on the least its own work can have taken.
    Time off a CPU that no run delay shows (a thread waiting for the GIL its preempted sibling holds) counts as work
    at the peers' rate: a rank 2x slower in one step beside burners, its extra run delay 30 ms of which the rate left
    6 ms as the host's, was named; held to all 30 it was not.

    Where every record also has ``on_cpu_us``, plus as much of its time on a CPU beyond its peers' as its core's
    slowness explains (:func:`_core_slowdown`: its optimizer step, the same work as its peers', is slower in its
    median step, by ``r - 1``): the same work running ``r`` x as long on a CPU is the CPU's speed, the host's, up to
    ``(r - 1)`` x the peers' time on a CPU. On a CPU-contended run too (one step's optimizer step is no witness
    there: 4 ranks on 2 cores, each rank's was 10 % slower than its peers' in 6-9 of 19 steps). Only that much: a rank
    spinning on its CPU for as long again as its passes took ran its optimizer step 17-20 % slower too (its caches
    cold after the spin), and 2-6x as long in compute. A rank slow while off a CPU (asleep, blocked, waiting for a
    device: the injected stragglers) keeps its excess, and so does a rank with more CPU work than a slower core
    explains (an eval pass, a metric, a busy loop): on a contended run too. Taking every rank-step's time on a CPU
    out there hid a rank that spun 40 ms a step in its forward pass (4 ranks on 2 cores: +37 % compute, the table
    charging it 50 ms of sync wait a step, no finding). A rank with more work of the job's own (the imbalance) is
    compared in compute and data loading by its work, not here.
    """
    s = rs.breakdown.table.steps
    rq = s.runqueue_wait_us.astype(np.float64)
    if COMPUTE in waits:
        rq = np.maximum(rq - waits[COMPUTE], 0.0)
    excess = np.nan_to_num(np.maximum(rq - median_of_others(key, rq, n_groups), 0.0))
    core = np.zeros_like(excess)
    slowdown = np.zeros_like(excess)
    if bool((s.on_cpu_us >= 0).all()):
        on_cpu = s.on_cpu_us.astype(np.float64)
        peers = median_of_others(key, on_cpu, n_groups)
        beyond = np.nan_to_num(np.maximum(on_cpu - peers, 0.0))
        slowdown = _core_slowdown(rs, _optimizer_ratio(rs, key, n_groups, waits.get(OPTIMIZER)))[rs.rank_index]
        core = np.minimum(beyond, np.nan_to_num(slowdown * peers))
    return excess + core, core, slowdown


def _phase_host_excess_us(
    rs: RankSteps,
    key: NDArray[np.int64],
    n_groups: int,
    phase: str,
    in_phase: NDArray[np.float64],
    *,
    core: NDArray[np.float64],
    slowdown: NDArray[np.float64],
) -> NDArray[np.float64]:
    """Per rank-step of a host-timed run: what the host took from one of its phases beyond its peers', µs.

    ``in_phase``: the run delay the SDK read across the phase (``data_runqueue_wait_us``,
    ``optimizer_runqueue_wait_us``). Its run delay there beyond the median of its (step, stage) peers' (the others of
    its group), plus as much of its slower core's part of the step (``core``, :func:`_host_excess_us`) as the same
    work would take longer on that core: ``slowdown`` x its peers' time in the phase, the most of it that can have
    run on a CPU. A loader slow while off a CPU (a slow disk, a remote store: asleep in the fetch) waited for none,
    and keeps its time; a rank whose fetches waited for a CPU longer than its peers' is the host's there. Before, a
    rank's whole extra host time, wherever in the step it fell, came out of each of these phases: in a run whose
    training threads waited for a CPU 56 % of the median step (six spinning processes on two cores), rank 1 of a
    2-rank Trainer job whose loader slept 80 ms a step lost up to 306 ms a step more than its peer to the host,
    most of it in its optimizer step; taken out of its data loading, that left 0-25 ms of it in 3 of 9 steps, and
    no finding named it (tests/data/trainer_slow_loader_runqueue).
    """
    took = rs.us(phase)
    waited = np.nan_to_num(np.maximum(in_phase - median_of_others(key, in_phase, n_groups), 0.0))
    slower = np.nan_to_num(slowdown * median_of_others(key, took, n_groups))
    return waited + np.minimum(core, slower)


def _step_jitter_us(rs: RankSteps) -> float:
    """The run's step-to-step jitter: the robust standard deviation over steps of the median rank's own time, µs.

    Own time (no waiting): a straggler lengthens everyone's step by their wait for it, not the median rank's own
    work, so its own effect never passes for the run's noise. In a job of two ranks the median is the mean of the two,
    which carries a straggler's own slow steps: there, the faster rank's (a 2-rank FSDP2 loop with one rank 40 ms
    slower every fifth step had 7 ms of "jitter" that way, against 3.5 ms on a clean run of it).
    """
    q = 0.0 if rs.n_ranks == 2 else 0.5
    return _robust_sigma(grouped_quantile(rs.step_index, own_time_us(rs), rs.n_steps, q))


ROUTED = "expert all-to-all bytes"
"""The work measure of :func:`routed_bytes`."""


def routed_bytes(rs: RankSteps) -> NDArray[np.float64] | None:
    """Per rank-step: the bytes it sent in expert-parallel all-to-alls (``ep`` ``all_to_all`` intervals).

    ``None`` where the run has none. An MoE layer's dispatch sends each rank's own routed tokens (alike on every rank
    of a balanced batch) and its combine sends back what the rank's experts computed: a rank whose experts the router
    favours sends more, in proportion to its extra expert work (a hot expert on one of 4 ranks: 2,048 tokens a step
    against 600-850, 2.1x the bytes of its peers). Its compute then follows the router, not the batch, and its
    tokens are its peers'.
    """
    table = rs.breakdown.table
    iv = table.intervals
    sel = (
        (iv.kind == COMM_CODE)
        & (iv.axis == AXES.index("ep"))
        & (iv.op == OPS.index(CommOp.ALL_TO_ALL))
        & (iv.size_bytes >= 0)
    )
    if not sel.any():
        return None
    return np.bincount(iv.row[sel], weights=iv.size_bytes[sel].astype(np.float64), minlength=table.n_rows).astype(
        np.float64
    )


def _own_compute_us(rs: RankSteps, in_compute: NDArray[np.float64]) -> NDArray[np.float64]:
    """Per rank-step of a host-timed run: its compute less the time it waited for a CPU in it, µs.

    ``in_compute`` is the run delay the SDK read across its compute phases (``compute_runqueue_wait_us``), blocked
    windows inside them included, which compute leaves out: the wake-up after a collective can wait for a core too,
    and taking that out of compute would make a rank that waits in collectives on a busy core look faster than it
    is. So it is at least its time on a CPU outside its other phases (``on_cpu_us`` less its data loading, optimizer
    step, checkpoint and time outside phases and collectives, where it ran at most that long), a bound the
    thread's own clock gives: on one core beside a spinning process, the wait read in compute left 10-14 ms of a
    compute of 21-31 ms, the time on a CPU 12-15 ms, higher in a quarter of the steps. At most its compute as measured.
    """
    measured = rs.us(COMPUTE)
    own = np.maximum(measured - in_compute, 0.0)
    on_cpu = rs.breakdown.table.steps.on_cpu_us
    if bool((on_cpu >= 0).all()):
        elsewhere = rs.us(DATA) + rs.us(OPTIMIZER) + rs.us(CHECKPOINT) + rs.us(OTHER)
        own = np.maximum(own, np.minimum(on_cpu.astype(np.float64) - elsewhere, measured))
    return own


def _optimizer_ratio(
    rs: RankSteps, key: NDArray[np.int64], n_groups: int, in_optimizer: NDArray[np.float64] | None = None
) -> NDArray[np.float64]:
    """Per rank-step: its optimizer step over the median of its (step, stage) peers' (NaN where either is 0).

    Each less the time it waited for a CPU in it, where the records say (``in_optimizer``,
    ``optimizer_runqueue_wait_us``): the witness of a slower core is the same work running slower while on a CPU,
    not a rank the scheduler kept off one (that wait is the host's already, and counted as such).
    """
    opt = rs.us(OPTIMIZER)
    if in_optimizer is not None:
        opt = np.maximum(opt - in_optimizer, 0.0)
    peers = median_of_others(key, opt, n_groups)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where((opt > 0) & (peers > 0), opt / peers, np.nan)


def _core_slowdown(rs: RankSteps, ratio: NDArray[np.float64]) -> NDArray[np.float64]:
    """Per rank of a host-timed run: how much slower its core ran than its peers' (``r - 1``; 0 below the bar).

    The bar is :data:`SLOWER_CORE_OPTIMIZER`.

    The witness is the optimizer step: the same work on every rank of a stage (the same parameters, or equal shards
    of them), all on a CPU, and no collective waits inside it. A rank whose optimizer step takes longer than its
    peers' in the median step runs on a slower core (on a virtual machine, its virtual CPU shares a physical core
    or its cache with another guest's load, which no counter in the guest shows), and its longer compute with the
    same work is the same slowness. A clean 2-rank nanoGPT-style run on a quiet 2-core VM: rank 1 +25 % in compute
    over all 40 steps, +41 % in its optimizer step, and on a CPU 3.7 ms longer per step, as much as its extra
    compute (0.41 x its peer's 15.0 ms on a CPU would allow 6.2 ms). A rank doing more CPU work than its peers in its
    compute (a metric, a log line) keeps its optimizer step's speed, or about (a spin of 20-70 ms a step left it
    17-20 % slower), and its excess beyond that. Without an optimizer step in the records, no rank has the witness.
    ``ratio``: :func:`_optimizer_ratio`.
    """
    known = np.isfinite(ratio)
    per_rank = np.nan_to_num(grouped_median(rs.rank_index[known], ratio[known], rs.n_ranks), nan=0.0)
    return np.where(per_rank >= 1.0 + SLOWER_CORE_OPTIMIZER, per_rank - 1.0, 0.0)


def _robust_sigma(values: NDArray[np.float64]) -> float:
    if values.size == 0:
        return 0.0
    return _MAD_TO_SIGMA * float(np.median(np.abs(values - np.median(values))))


def _stat(rs: RankSteps, column: NDArray[np.float64], rank_index: int) -> float | None:
    """Median of a stats column over one rank's steps, ``None`` if unmeasured."""
    mine = column[rs.rank_index == rank_index]
    mine = mine[np.isfinite(mine) & (mine >= 0)]
    return float(np.median(mine)) if mine.size else None


# ---------------------------------------------------------------------------------------------- straggler


@dataclass(frozen=True, slots=True)
class _Slow:
    rank_index: int
    phase: str
    excess_us: float
    """What the job waits for it per step: its median excess, or (transient) its excess summed and amortised."""
    phase_us: float
    peer_us: float
    """The rest of its stage (its peers that are not suspects), same steps."""
    steps: int
    """Steps it was slow in."""
    persistent: bool = True
    """Slow in (nearly) every step (:func:`_persistent`), not in a few (:func:`_transient`)."""
    slow_steps: tuple[int, ...] = ()
    """A transient straggler's slow steps (step numbers, ascending); empty for a persistent one."""
    steady_sigmas: float = 0.0
    """A persistent straggler's median excess in standard errors of its own steps' excess (their robust spread ÷
    √steps): how surely it is slower step by step, whatever the run's step time does; 0 for a transient one."""


def _stage_sizes(rs: RankSteps) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """Each rank's pipeline stage, and the ranks seen per stage."""
    stage = rs.coord_of_rank[:, AXES.index("pp")].astype(np.int64)
    stage = np.where(stage >= 0, stage, 0)
    return stage, np.bincount(stage)


def _minority(rs: RankSteps, suspects: NDArray[np.intp], excess: NDArray[np.float64]) -> NDArray[np.intp]:
    """The worst suspects of each stage, fewer than half of its ranks: a stage is never slower than itself.

    One of two is allowed (two ranks, one slower); exactly half only when the suspects are every rank the stage has
    on their nodes and the rest of the stage is on other nodes (a slow node). ``excess`` is indexed by rank index;
    the rest of a stage's suspects (the mildest) go back to the reference.
    """
    if suspects.size == 0:
        return suspects
    stage, sizes = _stage_sizes(rs)
    order = suspects[np.lexsort((-excess[suspects], stage[suspects]))]
    st = stage[order]
    first = np.searchsorted(st, st, side="left")
    place = np.arange(order.size) - first
    cap = np.maximum(1, (sizes - 1) // 2)
    keep = place < cap[st]
    for s in np.unique(st).tolist():
        here = st == s
        mine = order[here]
        if 2 * mine.size == sizes[s]:
            nodes = np.unique(rs.node_of_rank[mine])
            on_nodes = np.isin(rs.node_of_rank[stage == s], nodes)
            if on_nodes.sum() == mine.size and not on_nodes.all():
                keep[here] = True  # the whole of their nodes' share of the stage, the rest elsewhere: a slow node
                continue
        if mine.size > cap[s] and excess[mine[cap[s]]] >= MINORITY_TIE * excess[mine[cap[s] - 1]]:
            keep[here] = False  # the first left out is as slow as the last kept: which part is slow is a guess
    return np.sort(order[keep])


def _rest_reference(ctx: _Context, values: NDArray[np.float64], suspects: NDArray[np.intp]) -> NDArray[np.float64]:
    """Per rank-step, the median of its (step, stage) peers that are not suspects; NaN where there is none."""
    rest = ~np.isin(ctx.rs.rank_index, suspects)
    ref = np.full(ctx.n_peer_groups, np.nan)
    if rest.any():
        ref = grouped_median(ctx.peer_key[rest], values[rest], ctx.n_peer_groups)
    return ref[ctx.peer_key]


HOST_TIME_SAID = 0.01
"""A straggler finding says how much less than measured it holds a rank to (the host's time) from this share of its
phase time on."""


def _stragglers(ctx: _Context) -> list[Finding]:
    """Persistent stragglers (median excess over their steps), then transient ones (a few slow steps that add up).

    A suspect is confirmed against the *rest* of its stage (its peers that are not suspects themselves), never
    against a median it pulls up; suspects are at most half of their stage; a persistent straggler is above the rest
    in :data:`STRAGGLER_CONSISTENCY` of its steps by more than :data:`JITTER_SIGMAS` x the rest's own step-to-step
    jitter; a transient one's amortised excess stands out from its stage peers' (noise gives every rank a few slow
    steps). A finding costs the run's jitter (:data:`STEP_JITTER_SIGMAS`) and its phase explains the wait it is
    charged with (:data:`STRAGGLER_EXPLAINS`).
    """
    rs = ctx.rs
    best: dict[int, _Slow] = {}
    for phase in STRAGGLER_PHASES:
        for slow in _persistent(ctx, phase):
            if slow.rank_index not in best or slow.excess_us > best[slow.rank_index].excess_us:
                best[slow.rank_index] = slow
    for phase in STRAGGLER_PHASES:
        for i, slow in _transient(ctx, phase, exclude=best).items():
            if i not in best or slow.excess_us > best[i].excess_us:
                best[i] = slow
    if not best:
        return []
    best = _fewer_than_half(rs, best)
    if not best:
        return []
    findings = _node_findings(ctx, best)
    findings.sort(key=lambda f: -f.cost_seconds_per_step)
    return findings[:MAX_STRAGGLER_FINDINGS]


def _node_findings(ctx: _Context, best: dict[int, _Slow]) -> list[Finding]:
    """One finding per node of the confirmed suspects.

    Each is kept where it costs the run's jitter and its phases explain the wait it is charged with
    (:data:`STRAGGLER_EXPLAINS`).
    """
    rs = ctx.rs
    by_node: dict[int, list[_Slow]] = {}
    for slow in best.values():
        by_node.setdefault(int(rs.node_of_rank[slow.rank_index]), []).append(slow)
    suspects = np.array(sorted(best), dtype=np.intp)
    findings = []
    for group in by_node.values():
        members = sorted(group, key=lambda s: -s.excess_us)
        f = _straggler_finding(ctx, members)
        cost_us = f.cost_seconds_per_step * 1e6
        i = members[0].rank_index
        explained_us = max(members[0].excess_us, _phases_excess_us(ctx, i, suspects))
        # a transient one's cost of its slow steps alone holds no charge its ordinary steps took by chance
        by_chance = f.evidence["slow_steps_wait_per_member_seconds_per_step"] is None
        chance_us = _charged_by_chance_us(ctx, i, cost_us) if by_chance else 0.0
        beyond_us = cost_us - chance_us - _host_took_us(ctx, i)
        if _resolved(ctx, cost_us, members[0]) and explained_us >= STRAGGLER_EXPLAINS * beyond_us:
            findings.append(f)
    return findings


def _charged_by_chance_us(ctx: _Context, rank_index: int, cost_us: float) -> float:
    """The part of a rank's sync-wait charge per waiting rank that every rank of its stage is charged as well.

    Under noise some rank is last into every collective, and the cost table charges it; the typical (median) charge
    of the rank's stage peers on the same axis is what the rank would carry without its slowness, so its phases need
    to explain only the rest (:data:`STRAGGLER_EXPLAINS`). Four FSDP2 ranks on two cores beside a CPU burner, rank 3
    sleeping 40 ms outside its phases every fifth step (8 ms a step amortised): charged 15.7 ms a step per waiting
    rank, of which its peers' typical charge (14 of its 47 ms of rank time) is a third; before, no finding named it.
    """
    rs = ctx.rs
    caused = rs.caused_per_step_us[rank_index]
    axis = int(np.argmax(caused))
    total = float(caused[axis])
    stage, _ = _stage_sizes(rs)
    peers = np.flatnonzero(stage == stage[rank_index])
    peers = peers[peers != rank_index]
    if total <= 0 or peers.size == 0:
        return 0.0
    typical = float(np.median(rs.caused_per_step_us[peers, axis]))
    return cost_us * min(max(typical / total, 0.0), 1.0)


def _host_took_us(ctx: _Context, rank_index: int) -> float:
    """What the host took from a rank per step beyond its peers (:attr:`_Context.host_excess_us`, mean over its steps).

    Part of what made it late into its collectives, and so of the sync wait it is charged with, but not its phases'
    (they are compared without it): its phases need to explain only the rest (:data:`STRAGGLER_EXPLAINS`). Rank 1 of
    a 2-rank FSDP2 loop sleeping 40 ms every fifth step beside two spinning processes ran 30 % slower on its CPU than
    rank 0 in every step (its optimizer step 6.3 ms against 3.9: its core's share of the spinners): charged 16.2 ms a
    step, 6.1 ms of it the host's, its pauses 6.8 ms amortised; before, no finding named it (1 run in 12).
    """
    if ctx.host_excess_us is None:
        return 0.0
    mine = ctx.host_excess_us[ctx.rs.rank_index == rank_index]
    return float(np.mean(mine)) if mine.size else 0.0


def _resolved(ctx: _Context, cost_us: float, slow: _Slow) -> bool:
    """Whether a straggler costs the job something beyond the run's step-to-step jitter (:data:`STEP_JITTER_SIGMAS`).

    A persistent straggler's cost is its median over every step, whose noise is the jitter ÷ √steps: it is resolved
    there too where it costs :data:`PERSISTENT_MIN_SHARE` of the step (beside a CPU burner, a rank 3.8x slower in
    compute in 12 of 12 steps cost 27 % of a step whose own time jittered by 20 %). A transient one's cost is
    amortised over every step too: it is resolved there where it costs :data:`TRANSIENT_MIN_SHARE` of the step and
    its slow steps together stand :data:`NOISE_SIGMAS` standard errors above its peers (``k`` steps each ``e`` over
    them: ``e`` x √k at least 6 x the jitter): a rank 40 ms slower in every fifth step beside a spinning process
    (8 ms a step amortised, 18 % of a step whose own time jittered by 17 %) is named; a rank 6 ms slower in 6 steps
    of a run whose own time jitters by 3 ms (2 sigma a step, 4.9 together) is not.
    """
    bar = STEP_JITTER_SIGMAS * ctx.step_jitter_us
    if cost_us <= 0 or cost_us >= bar:
        return cost_us > 0
    averaged = bar / math.sqrt(max(ctx.rs.n_steps, 1))
    if slow.persistent:
        if cost_us < PERSISTENT_MIN_SHARE * ctx.step_us:
            return False
        # The run's step jitter cannot hide a slowness the rank shows step by step: a median excess of
        # STEADY_SIGMAS standard errors of its own steps' excess is no noise, however much the steps vary.
        return cost_us >= averaged or slow.steady_sigmas >= STEADY_SIGMAS
    spikes = (slow.phase_us - slow.peer_us) * math.sqrt(slow.steps) >= NOISE_SIGMAS * ctx.step_jitter_us
    return spikes and cost_us >= max(TRANSIENT_MIN_SHARE * ctx.step_us, averaged)


def _own_sync_wait_us(rs: RankSteps, rank_index: int) -> float:
    """The rank's median sync wait per step, µs: what it waits in collectives for others."""
    mine = rs.rank_index == rank_index
    waiting = rs.step_us[mine] - own_time_us(rs)[mine] - rs.us(BUBBLE)[mine]
    return float(np.median(waiting)) if waiting.size else 0.0


def _phases_excess_us(ctx: _Context, rank_index: int, suspects: NDArray[np.intp]) -> float:
    """The part of a rank's step its own phases explain.

    Its median excess over the rest of its stage (the peers that are not ``suspects``) in each of compute, data
    loading, the optimizer step and its time outside them (``other``), summed where positive. As measured: the host's
    share (:attr:`_Context.host_excess_us`) decides whether the rank is slower than its peers, not whether its
    phases are where it was late (a rank on a slower core that also does more work is late in its phases either way).
    """
    mine = ctx.rs.rank_index == rank_index
    more_work = ctx.work_ratio is not None and float(np.median(ctx.work_ratio[mine])) >= WORK_RATIO
    total = 0.0
    # More work to compute (or to load) is an imbalance, not the rank's own slowness.
    for phase in (OPTIMIZER, OTHER) if more_work else STRAGGLER_PHASES:
        measured = ctx.rs.us(phase)
        gap = (measured - _rest_reference(ctx, measured, suspects))[mine]
        gap = gap[np.isfinite(gap)]
        if gap.size:
            total += max(float(np.median(gap)), 0.0)
    return total


def _fewer_than_half(rs: RankSteps, best: dict[int, _Slow]) -> dict[int, _Slow]:
    """Persistent and transient suspects together, held to :func:`_minority` (fewer than half of their stage)."""
    excess = np.zeros(rs.n_ranks)
    for i, slow in best.items():
        excess[i] = slow.excess_us
    kept = set(_minority(rs, np.array(sorted(best), dtype=np.intp), excess).tolist())
    return {i: slow for i, slow in best.items() if i in kept}


def _persistent(ctx: _Context, phase: str) -> list[_Slow]:
    """Ranks whose ``phase`` is longer than the rest of their stage's in (nearly) every step.

    Candidates are the ranks above the median of the others of their (step, stage) group by the cost floor; the worst
    half of a stage at most is confirmed against the median of the peers that are not suspects (the rest), by more
    than the rest's own spread between ranks
    (:data:`NOISE_SIGMAS`) and step to step (:data:`JITTER_SIGMAS`), and by :data:`STRAGGLER_STEADY` of that in
    :data:`STRAGGLER_CONSISTENCY` of its steps.
    """
    rs = ctx.rs
    values, measured = ctx.phase_us(phase), ctx.reference_us(phase)
    # The others of its (step, stage) group, never a median with itself in it: in a pair that is the mean of the two,
    # which left a rank half its excess, and the host's share of it (taken out of the rank alone) could cancel that
    # half (a rank spinning 40 ms a step beside one peer: compute 53 ms vs 13 ms, 21 ms of it the host's, no suspect).
    peers = median_of_others(ctx.peer_key, measured, ctx.n_peer_groups)
    excess = grouped_median(rs.rank_index, values - peers, rs.n_ranks)
    peer_rank = grouped_median(rs.rank_index, peers, rs.n_ranks)
    floor = MIN_COST_SHARE * ctx.step_us
    hit = (excess >= floor) & (excess >= STRAGGLER_MIN_EXCESS * peer_rank)
    if phase in (COMPUTE, DATA) and ctx.work_ratio is not None:
        # More work than the peers (more to compute, more to load) is an imbalance, not a straggler.
        hit &= grouped_median(rs.rank_index, ctx.work_ratio, rs.n_ranks) < WORK_RATIO
    suspects = _minority(rs, np.flatnonzero(hit), excess)
    if suspects.size == 0:
        return []
    ref = _rest_reference(ctx, measured, suspects)
    gap = values - ref
    known = np.isfinite(gap)
    is_rest = ~np.isin(rs.rank_index, suspects)
    rest_rows = known & is_rest
    rest_excess = grouped_median(rs.rank_index[rest_rows], gap[rest_rows], rs.n_ranks)
    spread = NOISE_SIGMAS * _robust_sigma(rest_excess[np.isfinite(rest_excess)])
    sigma = _robust_sigma(gap[rest_rows])
    out = []
    for i in suspects.tolist():
        mine = (rs.rank_index == i) & known
        if not mine.any():
            continue
        over = float(np.median(gap[mine]))
        rest = float(np.median(ref[mine]))
        above = float(np.mean(gap[mine] >= STRAGGLER_STEADY * over))
        # The median of n noisy steps wanders by about sigma / sqrt(n): the bar for a median, not for one step.
        jitter = JITTER_SIGMAS * sigma / math.sqrt(int(np.count_nonzero(mine)))
        relative = CONTENDED_MIN_EXCESS if ctx.contention is not None else STRAGGLER_MIN_EXCESS
        if over < max(floor, spread, jitter, relative * rest) or above < STRAGGLER_CONSISTENCY:
            continue
        steps = int(np.count_nonzero(mine))
        own_error = _robust_sigma(gap[mine]) / math.sqrt(steps)
        steady = over / own_error if own_error > 0 else math.inf
        out.append(_Slow(i, phase, over, rest + over, rest, steps, steady_sigmas=steady))
    return out


def _transient(ctx: _Context, phase: str, *, exclude: dict[int, _Slow]) -> dict[int, _Slow]:
    """Ranks slow in some steps only: rank-steps above the same thresholds, their excess amortised over the steps.

    Under noise (shared cores, a busy host) every rank has a few slow steps; a transient straggler's amortised
    excess must cost :data:`TRANSIENT_MIN_SHARE` of the step and stand out from the other ranks' of its stage by
    that much and by :data:`NOISE_SIGMAS` x their spread. Each rank-step is held to the same relative bar as a
    persistent straggler (:data:`CONTENDED_MIN_EXCESS` on a contended run): a rank slower in all its steps by less is
    not named through this path either. On a contended run it is slow in :data:`CONTENDED_MIN_SLOW_STEPS` steps.

    In a stage of two ranks the spread between ranks is no yardstick (the robust spread of two values is half their
    gap: 6 of them always exceed it) and a median with the rank in it halves its gap: there a rank-step's excess is
    over its one peer, the rank stands out by :data:`PAIR_TRANSIENT_MIN_SHARE` of the step over that peer's amortised
    excess, and its slow steps fall in :data:`PAIR_MIN_STRETCHES` separate stretches (a periodic cost, not a burst).
    Rank 1 of a 2-rank FSDP2 loop sleeping 40 ms outside its phases every fifth step: the table charged it 10-12 ms
    of sync wait a step, and no finding named it before.
    """
    rs = ctx.rs
    values = ctx.phase_us(phase)
    stage, sizes = _stage_sizes(rs)
    in_pair = sizes[stage] == 2
    measured = ctx.reference_us(phase)
    peers = ctx.peer_median(measured)
    if in_pair.any():
        paired = in_pair[rs.rank_index]
        peers = np.where(paired, median_of_others(ctx.peer_key, measured, ctx.n_peer_groups), peers)
    excess = values - peers
    relative = CONTENDED_MIN_EXCESS if ctx.contention is not None else STRAGGLER_MIN_EXCESS
    floor = np.maximum(max(MIN_COST_SHARE * ctx.step_us, NOISE_SIGMAS * _robust_sigma(excess)), relative * peers)
    flag = excess >= floor
    if phase in (COMPUTE, DATA) and ctx.work_ratio is not None:
        flag &= ctx.work_ratio < WORK_RATIO
    if exclude:
        flag &= ~np.isin(rs.rank_index, list(exclude))
    rows = np.flatnonzero(flag)
    if rows.size == 0:
        return {}
    who = rs.rank_index[rows]
    amortised = np.bincount(who, weights=excess[rows], minlength=rs.n_ranks) / rs.steps_per_rank
    typical = grouped_median(stage, amortised, int(stage.max()) + 1)[stage]
    spread = NOISE_SIGMAS * _robust_sigma(amortised)
    least = TRANSIENT_MIN_SHARE * ctx.step_us
    stands_out = (amortised - typical >= max(least, spread)) & (amortised >= least)
    if in_pair.any():
        # typical is the pair's mean: over its peer by a share is over the mean by half of it
        apart = amortised - typical >= PAIR_TRANSIENT_MIN_SHARE * ctx.step_us / 2
        stretches = _stretches(rs.step_index[rows], who, rs.n_ranks)
        stands_out = np.where(in_pair, apart & (stretches >= PAIR_MIN_STRETCHES), stands_out)
    if ctx.contention is not None:
        stands_out &= np.bincount(who, minlength=rs.n_ranks) >= CONTENDED_MIN_SLOW_STEPS
    out = {}
    for i in _minority(rs, np.flatnonzero(stands_out), amortised).tolist():
        mine = rows[who == i]
        out[i] = _Slow(
            i,
            phase,
            float(amortised[i]),
            float(np.median(values[mine])),
            float(np.median(peers[mine])),
            int(mine.size),
            persistent=False,
            slow_steps=tuple(sorted(int(x) for x in rs.steps[rs.step_index[mine]])),
        )
    return out


CADENCE_MIN_STEPS = 3
"""A transient straggler's slow steps are called periodic from this many on one cadence ..."""
CADENCE_SHARE = 0.75
"""... when at least this share of its slow steps lie on it (noise adds a few others) and the cadence's own steps
are at least this share of those it spans (one missed is still a cadence)."""
STEPS_LISTED = 6
"""Slow steps a finding lists; more are elided."""


def cadence(steps: tuple[int, ...]) -> tuple[int, tuple[int, ...]] | None:
    """``(period, the steps on it)`` where most of ``steps`` (ascending) recur every ``period`` steps.

    An evaluation, a log flush or a save every N steps on one rank; ``None`` where they do not (bursts, scattered
    noise).

    The period is the commonest gap between consecutive slow steps (at least 2: consecutive steps are a burst); the
    steps on it are those of the commonest residue modulo the period.
    """
    if len(steps) < CADENCE_MIN_STEPS:
        return None
    gaps = np.diff(np.asarray(steps, dtype=np.int64))
    gaps = gaps[gaps >= 2]
    if gaps.size == 0:
        return None
    values, counts = np.unique(gaps, return_counts=True)
    period = int(values[np.argmax(counts)])
    residues, hits = np.unique(np.asarray(steps, dtype=np.int64) % period, return_counts=True)
    residue = int(residues[np.argmax(hits)])
    on = tuple(s for s in steps if s % period == residue)
    spanned = (on[-1] - on[0]) // period + 1
    if len(on) < CADENCE_MIN_STEPS or len(on) < CADENCE_SHARE * len(steps) or len(on) < CADENCE_SHARE * spanned:
        return None
    return period, on


def _steps_text(steps: tuple[int, ...]) -> str:
    """``3, 8 and 13``; ``3, 8, 13, …, 98`` past :data:`STEPS_LISTED`."""
    text = [str(s) for s in steps]
    if len(text) > STEPS_LISTED:
        return ", ".join([*text[: STEPS_LISTED - 1], "…", text[-1]])
    return text[0] if len(text) == 1 else ", ".join(text[:-1]) + " and " + text[-1]


def _when_slow(top: _Slow, total_steps: int) -> str:
    """`` in 20 of its 99 steps, every 5 steps (steps 4, 9, …, 99)``; empty for a rank slow in every step."""
    if top.steps >= total_steps:
        return ""
    when = f" in {top.steps} of its {total_steps} steps"
    if len(top.slow_steps) < 2:
        return when
    found = cadence(top.slow_steps)
    if found is None:
        return f"{when} (steps {_steps_text(top.slow_steps)})"
    period, on = found
    others = top.steps - len(on)
    also = f"; and {others} other{'s' * (others > 1)}" if others else ""
    return f"{when}, every {period} steps (steps {_steps_text(on)}{also})"


def _stretches(step_index: NDArray[np.intp], who: NDArray[np.intp], n_ranks: int) -> NDArray[np.int64]:
    """Per rank: how many separate stretches of consecutive steps its rows (``step_index``, ``who``) fall in."""
    order = np.lexsort((step_index, who))
    s, w = step_index[order].astype(np.int64), who[order]
    starts = np.ones(s.size, dtype=bool)
    starts[1:] = (w[1:] != w[:-1]) | (s[1:] - s[:-1] > 1)
    return np.bincount(w[starts], minlength=n_ranks).astype(np.int64)


def _ranks_text(ranks: list[int]) -> str:
    """``1``, ``1 and 2``, ``1, 2 and 5``."""
    text = [str(r) for r in sorted(ranks)]
    return text[0] if len(text) == 1 else ", ".join(text[:-1]) + " and " + text[-1]


def _host_time_left_out(ctx: _Context, top: _Slow) -> str:
    """Where the finding holds a rank to its phase less what the host took (:meth:`_Context.phase_us`), how much.

    The cost table's rows count a phase as measured (a rank waiting for a CPU in its compute computes, as far as the
    step's time goes): the finding's figure is then lower than the row's, and says by how much and why.
    """
    if ctx.host_excess_us is None:
        return ""
    rs = ctx.rs
    mine = rs.rank_index == top.rank_index
    if not mine.any():
        return ""
    took_us = float(np.median(rs.us(top.phase)[mine] - ctx.phase_us(top.phase)[mine]))
    if took_us < HOST_TIME_SAID * top.phase_us:
        return ""
    return (
        f" (its own time: {human_seconds(took_us / 1e6)} less per step than measured, the time it waited for a CPU "
        "or lost to a slower core, which the cost table counts)"
    )


TABLE_CHARGE_AGREES = 0.9
"""A transient straggler's cost is the table's sync-wait charge where its slow steps caused at least this share of it;
below, the finding quotes both (the rest is what its ordinary steps caused, the noise of a busy host)."""


def _slow_steps_wait_s(rs: RankSteps, slow: _Slow, axis: int, caused: WaitCaused) -> float:
    """The sync wait a transient straggler's slow steps caused on ``axis`` beyond its ordinary steps', per waiting rank.

    Summed over its slow steps, less the median of its other steps' for each, amortised over all its steps and
    divided among the ranks that wait (as :attr:`WaitCaused.per_member_seconds`). The table's figure, every wait
    charged to the rank, also holds those of its ordinary steps: on a busy host the last rank to arrive varies, and
    a helper's rank sleeping ~4.5 ms a step on average was charged 9.21 ms a step.

    Where its slow steps recur on a cadence (:func:`cadence`), every step of the rank on that cadence counts as a
    slow one: a periodic cost (an evaluation, a flush every N steps) recurs whether or not noise left it above the
    bar in each step, and a cadence step it cost nothing in adds nothing. Counting the flagged steps only, a DDP
    tutorial run whose rank 1 paused 40 ms every fifth step beside no load was costed 5.16 ms a step where the
    table charged it 7.43 and 8 ms a step was injected.
    """
    rows = np.flatnonzero(rs.rank_index == slow.rank_index)
    paid = rs.breakdown.wait_paid_us[rows, axis]
    numbers = rs.steps[rs.step_index[rows]]
    in_slow = np.isin(numbers, np.asarray(slow.slow_steps))
    found = cadence(slow.slow_steps)
    if found is not None:
        period, on = found
        in_slow |= numbers % period == on[0] % period
    ordinary = float(np.median(paid[~in_slow])) if (~in_slow).any() else 0.0
    extra = float(paid[in_slow].sum()) - ordinary * int(np.count_nonzero(in_slow))
    return max(0.0, extra) / max(rows.size, 1) / 1e6 / max(caused.waiting_ranks, 1)


def _straggler_finding(ctx: _Context, slow: list[_Slow]) -> Finding:
    rs = ctx.rs
    top = slow[0]
    i = top.rank_index
    # What it costs: the sync wait it made each waiting rank sit through (the cost table's own figure). Where nobody
    # waited on it in a collective (a job without communication, a pipeline's bubble): its phase's excess, less what
    # it spends itself waiting in collectives for a slower rank (its excess hides in that wait).
    axis = int(np.argmax(rs.caused_per_step_us[i]))
    caused = wait_caused(rs, i, axis)
    slow_steps_cost_s = None if caused is None or top.persistent else _slow_steps_wait_s(rs, top, axis, caused)
    if (
        caused is not None
        and slow_steps_cost_s is not None
        and slow_steps_cost_s >= TABLE_CHARGE_AGREES * (caused.per_member_seconds)
    ):
        slow_steps_cost_s = None  # its ordinary steps caused next to nothing: the table's figure is the slow steps'
    if caused is None:
        cost_s = max(0.0, top.excess_us - _own_sync_wait_us(rs, i)) / 1e6
    elif slow_steps_cost_s is not None:
        cost_s = slow_steps_cost_s
    else:
        cost_s = caused.per_member_seconds
    share = ctx.share(cost_s)
    node = rs.node_name(i)
    node_code = int(rs.node_of_rank[i])
    s = rs.breakdown.table.steps
    tokens = _stat(rs, s.tokens.astype(np.float64), i)
    peer_tokens = float(np.median(s.tokens[s.tokens >= 0])) if (s.tokens >= 0).any() else None
    gap_us = top.phase_us - top.peer_us
    relative = f" (+{percent(gap_us / top.peer_us)})" if top.peer_us >= gap_us / 100 else ""
    phase_word = _PHASE_WORDS[top.phase]
    on_node = int(np.count_nonzero(rs.node_of_rank == node_code))
    other_nodes = int(np.unique(rs.node_of_rank).size) > 1
    ranks = [int(rs.ranks[x.rank_index]) for x in slow]
    if len(slow) == 1:
        who = f"{ctx.where(i)} is"
    elif len(slow) == on_node and other_nodes:
        # Every rank of the node is slower than the rest of its stage, which lives on other nodes: the node is.
        who = f"{node} (all its {on_node} ranks: {_ranks_text(ranks)}; worst rank {int(rs.ranks[i])}) is"
    else:
        who = f"ranks {_ranks_text(ranks)} on {node} (worst: rank {int(rs.ranks[i])}) are each"
    work = "" if top.phase != COMPUTE or tokens is None else f" with the same work ({tokens:,.0f} tokens)"
    work += _host_time_left_out(ctx, top)
    total_steps = int(rs.steps_per_rank[i])
    when = _when_slow(top, total_steps)
    message = (
        f"{who} slow in {phase_word}{when}: {human_seconds(top.phase_us / 1e6)} per {'slow ' * bool(when)}step vs "
        f"{human_seconds(top.peer_us / 1e6)} on the rest of its stage{relative}{work}; "
    )
    amortised = ", amortised" if when else ""
    if caused is None:
        message += f"every rank waits about {human_seconds(cost_s)} per step for it ({percent(share)} of the step"
        message += f"{amortised})"
    elif slow_steps_cost_s is not None:
        # The table's figure holds every wait the rank caused, those of its ordinary steps too (on a busy host the
        # last rank to arrive varies): what its slow steps cost is what they caused beyond its ordinary steps.
        message += (
            f"its slow steps make each waiting rank of {caused.group} wait {human_seconds(cost_s)} per step "
            f"(amortised) beyond what its other steps do, {percent(share)} of the step; the cost table charges it "
            f"{human_seconds(caused.per_member_seconds)} per step, every wait it causes"
        )
    else:
        message += f"{caused.sentence()}, {percent(share)} of the step{amortised}"
    evidence: dict[str, float | int | None] = {
        "rank": int(rs.ranks[i]),
        "phase_seconds": top.phase_us / 1e6,
        "peer_median_seconds": top.peer_us / 1e6,
        "excess_seconds": top.excess_us / 1e6,
        "excess_ratio": gap_us / top.peer_us if top.peer_us > 0 else None,
        "cost_seconds_per_step": cost_s,
        "phase_is_compute": int(top.phase == COMPUTE),
        "phase_is_data": int(top.phase == DATA),
        "phase_is_optimizer": int(top.phase == OPTIMIZER),
        "phase_is_other": int(top.phase == OTHER),
        "wait_caused_seconds_per_step": None if caused is None else caused.total_seconds,
        "wait_per_member_seconds_per_step": None if caused is None else caused.per_member_seconds,
        "slow_steps_wait_per_member_seconds_per_step": slow_steps_cost_s,
        "tokens": tokens,
        "median_tokens": peer_tokens,
        "slow_ranks_on_node": len(slow),
        "ranks_on_node": on_node,
        "steps_slow": top.steps,
        "period_steps": None if (found := cadence(top.slow_steps)) is None else found[0],
        "share_of_step": share,
    }
    return Finding(
        code="straggler",
        severity=severity_for(share),
        message=message,
        evidence=evidence,
        suspects=tuple(ctx.suspect(x.rank_index) for x in slow),
        cost_seconds_per_step=cost_s,
    )


# ---------------------------------------------------------------------------------------------- data imbalance


def _imbalance(ctx: _Context) -> list[Finding]:
    rs = ctx.rs
    if ctx.work_ratio is None:
        return []
    compute = rs.us(COMPUTE)
    more = ctx.work_ratio >= WORK_RATIO
    if not more.any() or more.all():
        return []
    # Compare with the (step, stage) peers that carry the usual work, never with a median the busy ranks pull up;
    # the threshold is those peers' own jitter, so that shared cores or a busy host raise it and a quiet GPU does not.
    ref = grouped_median(ctx.peer_key[~more], compute[~more], ctx.n_peer_groups)[ctx.peer_key]
    with np.errstate(invalid="ignore", divide="ignore"):
        rel = np.where(ref > 0, compute / ref - 1.0, np.nan)
    normal = ~more & np.isfinite(rel)
    floor = max(IMBALANCE_MIN_EXCESS, JITTER_SIGMAS * _robust_sigma(rel[normal]))
    flagged = np.flatnonzero(more & np.isfinite(rel) & (rel >= floor))
    if flagged.size == 0:
        return []
    excess = compute[flagged] - ref[flagged]
    per_step = np.zeros(rs.n_steps)
    np.maximum.at(per_step, rs.step_index[flagged], excess)
    compute_cost_s = float(per_step.sum()) / rs.n_steps / 1e6
    by_rank = np.bincount(rs.rank_index[flagged], weights=excess, minlength=rs.n_ranks)
    i = int(np.argmax(by_rank))
    # What it costs: the sync wait the busiest rank made each waiting rank sit through (the cost table's figure);
    # the compute excess where nobody waited on it in a collective.
    caused = wait_caused(rs, i, int(np.argmax(rs.caused_per_step_us[i])))
    cost_s = compute_cost_s if caused is None else caused.per_member_seconds
    share = ctx.share(cost_s)
    if share < MIN_COST_SHARE:
        return []
    mine = flagged[rs.rank_index[flagged] == i]
    work_of = _work_of(ctx, mine, ~more)
    (tokens, peer_tokens), (longest, peer_longest), (work, peer_work) = work_of.tokens, work_of.longest, work_of.work
    steps_hit = int(np.unique(rs.step_index[flagged]).size)
    routing = work_of.routed_only
    replica = [] if routing else _heavy_replica(rs, i, flagged)
    of_replica = ""
    if len(replica) > 1:  # tp and cp ranks of one data-parallel replica get the same batch
        dp = int(rs.coord_of_rank[i, AXES.index("dp")])
        of_replica = f", of dp replica {dp}: ranks {_ranks_text([int(rs.ranks[r]) for r in replica])} get its batch"
    message = (
        (
            f"step time follows the router: in {steps_hit} of {rs.n_steps} steps a rank whose experts get more of "
            f"the routed tokens computes {percent(float(np.median(rel[flagged])))} longer than its stage peers with "
            f"the usual load; worst is {ctx.where(i)} ({', '.join(work_of.parts)}, {mine.size} steps); "
        )
        if routing
        else (
            f"step time follows the busiest rank's work: in {steps_hit} of {rs.n_steps} steps a rank with more work "
            f"computes {percent(float(np.median(rel[flagged])))} longer than its stage peers with the usual work; "
            f"worst is {ctx.where(i)} ({', '.join(work_of.parts) or ctx.work_name}, {mine.size} steps{of_replica}); "
        )
    )
    if caused is None:
        message += f"it costs every rank about {human_seconds(cost_s)} per step ({percent(share)} of the step)"
    else:
        message += f"{caused.sentence()}, {percent(share)} of the step"
    evidence: dict[str, float | int | None] = {
        "rank": int(rs.ranks[i]),
        "tokens": tokens,
        "median_tokens": peer_tokens,
        "longest_sequence": longest,
        "median_longest_sequence": peer_longest,
        "attention_work": work,
        "median_attention_work": peer_work,
        "expert_all_to_all_bytes": work_of.routed[0],
        "median_expert_all_to_all_bytes": work_of.routed[1],
        "compute_excess_ratio": float(np.median(rel[mine])),
        "steps_affected": steps_hit,
        "rank_steps_affected": int(flagged.size),
        "cost_seconds_per_step": cost_s,
        "compute_excess_seconds_per_step": compute_cost_s,
        "wait_caused_seconds_per_step": None if caused is None else caused.total_seconds,
        "wait_per_member_seconds_per_step": None if caused is None else caused.per_member_seconds,
        "share_of_step": share,
    }
    return [
        Finding(
            code="expert-imbalance" if routing else "data-imbalance",
            severity=severity_for(share),
            message=message,
            evidence=evidence,
            suspects=(ctx.suspect(i), *(ctx.suspect(r) for r in replica if r != i)),
            cost_seconds_per_step=cost_s,
        )
    ]


def _heavy_replica(rs: RankSteps, i: int, flagged: NDArray[np.intp]) -> list[int]:
    """Rank ``i`` and the others of its data-parallel replica that computed more in a flagged rank-step too.

    A replica is a dp coordinate: its tp, cp and pp ranks get the same batch. Rank indexes, ``i`` first.
    """
    dp = rs.coord_of_rank[:, AXES.index("dp")]
    heavy = np.unique(rs.rank_index[flagged])
    same = heavy[dp[heavy] == dp[i]]
    return [i, *(int(r) for r in same if r != i)]


_Pair = tuple[float | None, float | None]


@dataclass(frozen=True, slots=True, kw_only=True)
class _Work:
    """A rank's work in its flagged rank-steps beside its peers' with the usual work (medians), and the words."""

    tokens: _Pair
    longest: _Pair
    work: _Pair
    """Attention work."""
    routed: _Pair
    """Expert all-to-all bytes (:func:`routed_bytes`)."""
    parts: list[str]
    routed_only: bool
    """Its expert traffic is above its peers' and none of its batch's measures is: the router gave it the work."""


def _work_of(ctx: _Context, mine: NDArray[np.intp], usual: NDArray[np.bool_]) -> _Work:
    """The work of the rank-steps ``mine`` against the medians of their (step, stage) peers with the usual work.

    ``usual``: the rank-steps with the usual work (the reference of the compute comparison too): a median the busy
    ranks pull up would read an injected 3x as 1.5x where half the ranks carry it.
    """
    s = ctx.rs.breakdown.table.steps

    def ratio_of(column: NDArray[np.float64] | None) -> _Pair:
        if column is None or not (np.isfinite(column) & (column >= 0)).all():
            return None, None
        peers = grouped_median(ctx.peer_key[usual], column[usual], ctx.n_peer_groups)[ctx.peer_key]
        return float(np.median(column[mine])), float(np.nanmedian(peers[mine]))

    tokens, peer_tokens = ratio_of(s.tokens.astype(np.float64))
    longest, peer_longest = ratio_of(s.longest_sequence.astype(np.float64))
    work, peer_work = ratio_of(s.attention_work)
    routed, peer_routed = ratio_of(routed_bytes(ctx.rs))
    parts = []
    if tokens is not None and peer_tokens:
        parts.append(f"{tokens:,.0f} tokens vs a median {peer_tokens:,.0f}")
    if longest is not None and peer_longest:
        parts.append(f"longest sequence {longest:,.0f} vs {peer_longest:,.0f}")
    if work is not None and peer_work:
        parts.append(f"attention work {work / peer_work:.2f}x the median")
    more_routed = routed is not None and bool(peer_routed) and routed >= WORK_RATIO * (peer_routed or 0.0)
    if more_routed and routed is not None and peer_routed:
        parts.append(
            f"expert all-to-all {human_bytes(routed)} vs a median {human_bytes(peer_routed)} sent per step, "
            f"{routed / peer_routed:.2f}x"
        )
    batch_more = any(
        mine_v is not None and bool(peer_v) and mine_v >= WORK_RATIO * (peer_v or 0.0)
        for mine_v, peer_v in ((tokens, peer_tokens), (longest, peer_longest), (work, peer_work))
    )
    routed_only = more_routed and not batch_more
    if routed_only:  # its batch is its peers': say so in a word, and what the router sent it
        parts = [f"{tokens:,.0f} tokens like its peers" if tokens is not None else "the usual batch", parts[-1]]
    return _Work(
        tokens=(tokens, peer_tokens),
        longest=(longest, peer_longest),
        work=(work, peer_work),
        routed=(routed, peer_routed),
        parts=parts,
        routed_only=routed_only,
    )


# ---------------------------------------------------------------------------------------------- slow link


@dataclass(frozen=True, slots=True, kw_only=True)
class _LinkVerdict:
    nodes: NDArray[np.int64]
    """The suspect nodes, most suspect first (several: they cannot be told apart, or they fill a domain)."""
    domain: int | None
    """The NVLink domain (place code) when the verdict is a whole domain."""
    slowed: NDArray[np.bool_]
    """The transfers it slowed."""
    normal_us: NDArray[np.float64]
    """What each transfer should have taken."""
    against: str
    """What "normal" is."""


def _nodes_of_place(rs: RankSteps, place: int) -> NDArray[np.int64]:
    rows = place_of_rows(rs.breakdown.table) == place
    return np.unique(rs.breakdown.table.steps.node[rows]).astype(np.int64)


def _slow_link(ctx: _Context, tr: Transfers | None) -> list[Finding]:
    """Transfers slower than they should be, all through one node's network or inside one NVLink domain."""
    if tr is None:
        return []
    verdict = _link_verdict(ctx.rs, tr)
    if verdict is None:
        return []
    return _slow_link_finding(ctx, tr, verdict)


def _link_verdict(rs: RankSteps, tr: Transfers) -> _LinkVerdict | None:
    """Which transfers are slow, and what they all run through.

    A transfer is slow when its time per bus byte is at least :data:`SLOW_LINK_RATIO` x the fast end (the
    :data:`SLOW_LINK_BASE_QUANTILE` quantile) of its class (axis, op, group size, link), or, with a spec, at least
    :data:`SLOW_LINK_PLAN_RATIO` x the plan's link model (the only reference when a slow node sits in every group of
    a class). Slow transfers that cross the network point at a node's network: the suspects are the nodes every one
    of them runs through (several when they always appear together); slow transfers inside an NVLink domain point at
    that domain. Whichever of the two holds more of the excess wins; the suspect must take part in at least
    :data:`SLOW_LINK_CONCENTRATION` of the slow transfers and at least :data:`SLOW_LINK_CONSISTENCY` of its own
    transfers must be slow, or nothing is reported (scattered slowness is jitter or many causes, not one link).
    """
    n_cls = int(tr.cls.max()) + 1
    per_byte = tr.transfer_us / tr.bus_bytes
    normal = grouped_quantile(tr.cls, per_byte, n_cls, SLOW_LINK_BASE_QUANTILE)[tr.cls] * tr.bus_bytes
    slowed = tr.transfer_us >= SLOW_LINK_RATIO * normal
    if tr.planned_us is not None:
        by_plan = ~slowed & (tr.transfer_us >= SLOW_LINK_PLAN_RATIO * tr.planned_us)
        normal = np.where(by_plan, tr.planned_us, normal)
        slowed |= by_plan
    if not slowed.any():
        return None
    excess = np.where(slowed, tr.transfer_us - normal, 0.0)
    network = slowed & tr.crosses
    inside = slowed & ~tr.crosses
    domain: int | None = None
    if excess[network].sum() >= excess[inside].sum():
        n = int(np.count_nonzero(network))
        counts = tr.count_by_node(network)
        nodes = np.flatnonzero(counts >= (1.0 - SLOW_LINK_TIE) * counts.max())
        if counts.max() < SLOW_LINK_CONCENTRATION * n:
            return None
        healthy = tr.count_by_node(~slowed & tr.crosses)
        nodes = nodes[np.lexsort((nodes, healthy[nodes], -counts[nodes]))]  # most slow, fewest healthy transfers first
        through = _through(tr.pair_transfer[tr.pair_node == nodes[0]], tr.axis.size) & tr.crosses
        chosen = network & through
    else:
        n = int(np.count_nonzero(inside))
        places = np.bincount(tr.place[inside[tr.place_transfer]])
        domain = int(np.argmax(places))
        if places[domain] < SLOW_LINK_CONCENTRATION * n:
            return None
        nodes = _nodes_of_place(rs, domain)
        through = _through(tr.place_transfer[tr.place == domain], tr.axis.size) & ~tr.crosses
        chosen = inside & through
    if np.count_nonzero(chosen) < SLOW_LINK_CONSISTENCY * np.count_nonzero(through):
        return None  # a faulty link slows (nearly) all its transfers; a few slow ones among many are jitter
    against = (
        "the plan"
        if tr.planned_us is not None and np.array_equal(normal[chosen], tr.planned_us[chosen])
        else ("the same transfers elsewhere")
    )
    if against != "the plan" and not _faster_elsewhere(tr, per_byte, chosen=chosen, through=through):
        return None
    return _LinkVerdict(nodes=nodes, domain=domain, slowed=chosen, normal_us=normal, against=against)


def _faster_elsewhere(
    tr: Transfers, per_byte: NDArray[np.float64], *, chosen: NDArray[np.bool_], through: NDArray[np.bool_]
) -> bool:
    """Whether transfers of the slow ones' classes that do not run through the suspect exist and are faster.

    "Slower than elsewhere" needs an elsewhere: without one (a single node or domain) slowness is the link's jitter
    or the whole machine, never one place.
    """
    outside = ~through & np.isin(tr.cls, np.unique(tr.cls[chosen]))
    if not outside.any():
        return False
    return float(np.median(per_byte[chosen])) >= SLOW_LINK_RATIO * float(np.median(per_byte[outside]))


def _through(index: NDArray[np.intp], n: int) -> NDArray[np.bool_]:
    mask = np.zeros(n, dtype=bool)
    mask[index] = True
    return mask


def _slow_link_finding(ctx: _Context, tr: Transfers, verdict: _LinkVerdict) -> list[Finding]:
    rs = ctx.rs
    slowed = verdict.slowed
    if not slowed.any():
        return []
    excess = tr.transfer_us - verdict.normal_us
    # The job waits for its most delayed rank: per rank-step, the exposed excess of the slowed transfers it takes part
    # in; per step, the largest of them; averaged over the steps.
    delay = np.where(slowed, np.maximum(excess, 0.0) * tr.exposed, 0.0)
    per_row = np.bincount(tr.row, weights=delay[tr.row_transfer], minlength=rs.breakdown.table.n_rows)
    per_step = np.zeros(rs.n_steps)
    np.maximum.at(per_step, rs.step_index, per_row)
    cost_s = float(per_step.mean()) / 1e6
    share = ctx.share(cost_s)
    if share < MIN_COST_SHARE or cost_s * 1e6 < STEP_JITTER_SIGMAS * ctx.step_jitter_us:
        return []
    table = rs.breakdown.table
    axis = int(np.bincount(tr.axis[slowed], weights=excess[slowed], minlength=len(AXES)).argmax())
    mine = slowed & (tr.axis == axis)
    slow_t = float(np.median(tr.transfer_us[mine]))
    normal_t = float(np.median(verdict.normal_us[mine]))
    size = float(np.median(tr.size_bytes[mine]))
    code = int(tr.group[mine][int(np.argmax(excess[mine]))])
    group = table.group_name(code) if code >= 0 else None
    names = [table.node_name(int(n)) for n in verdict.nodes]
    where = _link_place(rs, verdict, names)
    axis_name = AXES[axis].value
    ratio = float(np.median(tr.transfer_us[slowed] / verdict.normal_us[slowed]))
    send = OPS.index(CommOp.SEND)
    what = "pipeline sends" if (axis_name == "pp" and tr.op[mine][0] == send) else f"{axis_name} transfers"
    message = (
        f"transfers through {where} (collectives of groups that include it, messages to or from it) take "
        f"{ratio:.2f}x as long as {verdict.against} ({what}: {human_seconds(slow_t / 1e6)} vs "
        f"{human_seconds(normal_t / 1e6)} for {human_bytes(size)}, counted from the last member's arrival, so not "
        f"sync wait): a slow link; it costs every rank about {human_seconds(cost_s)} per step ({percent(share)} of "
        f"the step)"
    )
    evidence: dict[str, float | int | None] = {
        "slowdown_ratio": ratio,
        "transfer_seconds": slow_t / 1e6,
        "expected_transfer_seconds": normal_t / 1e6,
        "message_bytes": size,
        "achieved_bandwidth_bytes_per_s": size / (slow_t / 1e6),
        "expected_bandwidth_bytes_per_s": size / (normal_t / 1e6) if normal_t > 0 else None,
        "compared_with_plan": int(verdict.against == "the plan"),
        "transfers_slowed": int(np.count_nonzero(slowed)),
        "transfers": int(slowed.size),
        "suspect_nodes": int(verdict.nodes.size),
        "whole_nvlink_domain": int(verdict.domain is not None),
        "cost_seconds_per_step": cost_s,
        "share_of_step": share,
    }
    suspects = []
    for n, name in zip(verdict.nodes.tolist(), names, strict=True):
        on_node = np.flatnonzero(rs.node_of_rank == n)
        suspects.append(Suspect(rank=int(rs.ranks[on_node[0]]) if on_node.size else None, node=name, group=group))
    return [
        Finding(
            code="slow-link",
            severity=severity_for(share),
            message=message,
            evidence=evidence,
            suspects=tuple(suspects),
            cost_seconds_per_step=cost_s,
        )
    ]


def _link_place(rs: RankSteps, verdict: _LinkVerdict, names: list[str]) -> str:
    """``node-3``; ``NVLink domain nvl-1 (nodes ...)``; ``one of node-0, node-1 (...)``; or no common place."""
    shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
    table = rs.breakdown.table
    if verdict.domain is not None:
        n_domains = len(table.nvlink_domain_names) or int(table.steps.nvlink_domain.max(initial=-1)) + 1
        if verdict.domain < n_domains:
            code = verdict.domain
            label = table.nvlink_domain_names[code] if table.nvlink_domain_names else f"nvl-{code}"
            return f"NVLink domain {label} (nodes {shown})"
    if not names:
        return "many groups (no node or NVLink domain is common to all of them)"
    if len(names) == 1:
        return names[0]
    return f"one of {shown} (always in the same transfers, so they cannot be told apart)"


# ---------------------------------------------------------------------------------------------- placement


def _crossing_groups(rs: RankSteps, axis: int) -> tuple[int, int, str | None] | None:
    """(groups crossing NVLink domains, groups, one crossing group) from the records' domains; ``None`` if unknown."""
    table = rs.breakdown.table
    iv = table.intervals
    sel = np.flatnonzero((iv.kind == COMM_CODE) & (iv.axis == axis) & (iv.group >= 0))  # comm
    if sel.size == 0:
        return None
    domain = table.steps.nvlink_domain[iv.row[sel]].astype(np.int64)
    if (domain < 0).any():
        return None
    group = iv.group[sel].astype(np.int64)
    pairs = distinct(group * (int(domain.max()) + 1) + domain)
    pair_group = pairs // (int(domain.max()) + 1)
    groups, per_group = np.unique(pair_group, return_counts=True)
    crossing = groups[per_group > 1]
    example = table.group_name(int(crossing[0])) if crossing.size else None
    return int(crossing.size), int(groups.size), example


def _placement(ctx: _Context, *, plan: Plan | None, spec: JobSpec | None, transfers: Transfers | None) -> list[Finding]:
    """An axis other than dp/pp whose groups cross NVLink domains, with exposed transfer above a share of the step.

    Crossing groups come from the records' NVLink domains, else from the spec's placement (the plan). The achieved
    bandwidth is the median bus bytes per second of the axis' transfers that cross a domain.
    """
    rs = ctx.rs
    findings = []
    for axis_index, axis in enumerate(AXES):
        if axis.value in _NON_PLACEMENT_AXES:
            continue
        transfer = rs.us(comm_category(axis, TRANSFER))
        median_us = float(np.median(transfer))
        share = ctx.share(median_us / 1e6)
        if share < PLACEMENT_MIN_SHARE:
            continue
        crossing = _crossing_groups(rs, axis_index)
        if crossing is None and plan is not None:
            planned = [c for c in plan.collectives if c.axis == axis.value and c.group == axis.value]
            if planned:
                crossing = (planned[0].groups_crossing_domains, planned[0].groups, None)
        if crossing is None or crossing[0] == 0:
            continue
        n_cross, n_groups, example = crossing
        worst = int(np.argmax(rs.rank_mean_us[:, CATEGORY_INDEX[comm_category(axis, TRANSFER)]]))
        bytes_per_step = _axis_bytes_per_step(rs, axis_index)
        achieved: float | None = None
        if transfers is not None:
            mine = (transfers.axis == axis_index) & transfers.crosses
            if mine.any():
                achieved = float(np.median(transfers.bus_bytes[mine] / transfers.transfer_us[mine])) * 1e6
        evidence: dict[str, float | int | None] = {
            "groups_crossing_domains": n_cross,
            "groups": n_groups,
            "exposed_transfer_seconds": median_us / 1e6,
            "bytes_per_step": bytes_per_step,
            "achieved_bandwidth_bytes_per_s": achieved,
            "nvlink_bandwidth_bytes_per_s": spec.hardware.scaleup_bandwidth_bytes_per_s if spec else None,
            "network_bandwidth_bytes_per_s": spec.hardware.nic_bandwidth_bytes_per_s if spec else None,
            "share_of_step": share,
        }
        link = (
            f" (NVLink {human_bytes(spec.hardware.scaleup_bandwidth_bytes_per_s)}/s, network "
            f"{human_bytes(spec.hardware.nic_bandwidth_bytes_per_s)}/s per GPU and direction)"
            if spec
            else ""
        )
        rate = f" at {human_bytes(achieved)}/s per GPU" if achieved else ""
        message = (
            f"{n_cross} of {n_groups} {axis.value} groups cross an NVLink domain: their {axis.value} traffic "
            f"({human_bytes(bytes_per_step)} per GPU per step) goes over the slower link{rate}{link} and "
            f"{human_seconds(median_us / 1e6)} per step of it is exposed ({percent(share)} of the step); keep "
            f"{axis.value} groups inside a domain (rank order, placement) or shrink {axis.value}"
        )
        findings.append(
            Finding(
                code="placement",
                severity=severity_for(share),
                message=message,
                evidence=evidence,
                suspects=(ctx.suspect(worst, group=example or rs.group_name(worst, axis_index)),),
                cost_seconds_per_step=median_us / 1e6,
            )
        )
    return findings


def _axis_bytes_per_step(rs: RankSteps, axis: int) -> float:
    """Median over rank-steps that communicate on ``axis`` of the bytes of their collectives, bytes."""
    iv = rs.breakdown.table.intervals
    sel = np.flatnonzero((iv.axis == axis) & (iv.size_bytes >= 0) & (iv.kind >= COMM_CODE))
    if sel.size == 0:
        return 0.0
    per_row = np.bincount(iv.row[sel], weights=iv.size_bytes[sel], minlength=rs.breakdown.table.n_rows)
    return float(np.median(per_row[per_row > 0])) if (per_row > 0).any() else 0.0


# ---------------------------------------------------------------------------------------------- job-wide categories


def _delay_seconds(finding: Finding) -> float:
    """How long a root-cause finding holds up the ranks that wait for it, per step.

    A pipeline waits for a slow rank's whole excess (its stage's passes start that much later), whatever the sync
    wait the rank is charged with.
    """
    excess = finding.evidence.get("excess_seconds") or finding.evidence.get("compute_excess_seconds_per_step") or 0.0
    return max(finding.cost_seconds_per_step, float(excess))


STAGE_WORK = (COMPUTE, OPTIMIZER, OTHER)
"""What a pipeline stage's ranks do themselves, compared between stages (:func:`_slow_stage`): their transfers, data
loading and checkpoints have findings of their own (a slow link, a network crossing only one stage's groups, a
loader that only the first stage waits for, a checkpoint only some ranks write)."""


def _slow_stage(ctx: _Context, *, plan: Plan | None, stragglers: Sequence[Finding]) -> list[Finding]:
    """A pipeline stage slower than the others as a whole, which they wait for in their bubble.

    A stage's time is its slowest rank's :data:`STAGE_WORK` per step (median over steps): a stage's pass ends with
    its last rank. Its pace is that over what the plan expects of the stage's work (the stages' layers, embedding and
    output differ), or, without a plan, the time itself. The slowest stage by pace is named where it is
    :data:`SLOW_STAGE_RATIO` x the next, and what it costs, its time beyond what it would take at the next stage's
    pace or beyond the slowest other stage's time (the pipeline would then wait for that one), is
    :data:`SLOW_STAGE_MIN_SHARE` of the step and the run's jitter. With pipeline parallelism alone a stage has no
    peers to be a straggler against: before, a rank computing 3x as long on a pp=2 run was named by no finding.
    Where a straggler finding already names one of the stage's ranks, the stage is slow through that rank.
    """
    rs = ctx.rs
    stage_of_rank = rs.coord_of_rank[:, AXES.index("pp")]
    stages = np.unique(stage_of_rank[stage_of_rank >= 0])
    if stages.size < 2:
        return []
    work = np.add.reduce([rs.us(c) for c in STAGE_WORK])
    own = grouped_median(rs.rank_index, work, rs.n_ranks)
    members = [np.flatnonzero(stage_of_rank == s) for s in stages.tolist()]
    measured = np.array([own[m].max() for m in members])
    expected, planned = np.ones(stages.size), False
    if plan is not None and len(plan.stages) == int(stages.max()) + 1:
        per_stage = np.array([sum(stage_expected(plan, s).get(c) or 0.0 for c in STAGE_WORK) for s in stages.tolist()])
        if bool((per_stage > 0).all()):
            expected, planned = per_stage * 1e6, True
    pace = measured / expected
    order = np.argsort(pace)
    top, runner = int(order[-1]), int(order[-2])
    if not pace[runner] > 0 or pace[top] < SLOW_STAGE_RATIO * pace[runner]:
        return []
    named = {s.rank for f in stragglers if f.code == "straggler" for s in f.suspects}
    if any(int(rs.ranks[i]) in named for i in members[top].tolist()):
        return []
    # What the step would lose with the stage at the next one's pace: the pipeline then waits for whichever stage is
    # slowest of the rest, or for this one at that pace.
    others = np.delete(measured, top)
    cost_us = float(measured[top] - max(pace[runner] * expected[top], float(others.max())))
    share = ctx.share(cost_us / 1e6)
    if share < SLOW_STAGE_MIN_SHARE or cost_us < STEP_JITTER_SIGMAS * ctx.step_jitter_us:
        return []
    stage, other = int(stages[top]), int(stages[runner])
    worst = int(members[top][np.argmax(own[members[top]])])
    ratio = float(pace[top] / pace[runner])
    basis = (
        f"{ratio:.2f}x as slow as stage {other} against what the plan expects of each"
        if planned
        else f"{ratio:.2f}x as long (no plan to say how uneven the stages should be)"
    )
    message = (
        f"pipeline stage {stage} is slower than the other stages, which wait for it: {ctx.where(worst)} takes "
        f"{human_seconds(float(measured[top]) / 1e6)} per step in compute, optimizer and host work against "
        f"{human_seconds(float(measured[runner]) / 1e6)} on stage {other}'s slowest rank, {basis}; "
        f"the other stages wait about {human_seconds(cost_us / 1e6)} per step for it ({percent(share)} of the step): "
        f"look at stage {stage}'s ranks, or move layers off it (Megatron-LM: --decoder-first-pipeline-num-layers / "
        "--decoder-last-pipeline-num-layers; torch.distributed.pipelining: the split points)"
    )
    return [
        Finding(
            code="slow-pipeline-stage",
            severity=severity_for(share),
            message=message,
            evidence={
                "stage": stage,
                "rank": int(rs.ranks[worst]),
                "work_seconds": float(measured[top]) / 1e6,
                "next_stage": other,
                "next_stage_work_seconds": float(measured[runner]) / 1e6,
                "pace_ratio": ratio,
                "planned": int(planned),
                "cost_seconds_per_step": cost_us / 1e6,
                "share_of_step": share,
            },
            suspects=(ctx.suspect(worst, group=rs.group_name(worst, AXES.index("pp"))),),
            cost_seconds_per_step=cost_us / 1e6,
        )
    ]


def _bubble(ctx: _Context, *, plan: Plan | None, explained_seconds: float) -> list[Finding]:
    """Measured pipeline waiting vs what the plan's schedule implies on the run's own compute.

    Pipeline waiting is the bubble plus the exposed pp transfer: where the planner's overlap model and the
    breakdown's bytes/bandwidth split draw the line between them differently, their sum still compares. The
    expectation is like for like (:func:`~meshscope.analysis.costs.expected_pipeline`): the plan's bubble fraction
    ÷ (pp - 1) times the measured passes (compute and in-pass tp/cp/ep transfers and waits) of the stages the slowest
    one waits on, plus each stage's measured wait for the slowest stage, plus the plan's exposed pp transfer; a job
    computing 1.4x slower than planned expects a 1.4x longer bubble, not a finding. A bubble that root causes found
    here (stragglers, imbalance, slow links, a starved loader, checkpoint stalls) can explain — at most twice the
    delay they cause (:func:`_delay_seconds`) — is their symptom and not reported again.
    """
    if plan is None:
        return []
    pipeline = expected_pipeline(ctx.rs, plan)
    if pipeline is None:
        return []
    rs = ctx.rs
    expected_us = pipeline.waiting_us
    waiting = rs.us(BUBBLE) + rs.us(comm_category("pp", TRANSFER))
    measured_s = float(np.median(waiting)) / 1e6
    expected_s = float(np.median(expected_us)) / 1e6
    excess_s = float(np.median(waiting - expected_us)) / 1e6
    share = ctx.share(excess_s)
    if measured_s < BUBBLE_MIN_RATIO * expected_s or share < BUBBLE_MIN_SHARE or excess_s <= 2 * explained_seconds:
        return []
    worst = int(np.argmax(rs.rank_mean_us[:, CATEGORY_INDEX[BUBBLE]]))
    step_s = ctx.step_us / 1e6
    message = (
        f"pipeline waiting (bubble + exposed pp transfer) is {human_seconds(measured_s)} per step "
        f"({percent(measured_s / step_s)} of the step) against {human_seconds(expected_s)} expected of pp "
        f"{plan.layout.pp}, {plan.micro_batches} micro-batches, {plan.schedule.value} on this run's compute "
        f"({pipeline.basis(plan)}; plus the stage's exposed pp transfer); the excess costs {human_seconds(excess_s)} "
        f"per step ({percent(share)}): more micro-batches, interleaving (vpp) or balancing the stages would cut it"
    )
    return [
        Finding(
            code="bubble-above-plan",
            severity=severity_for(share),
            message=message,
            evidence={
                "measured_seconds": measured_s,
                "expected_seconds": expected_s,
                "planned_bubble_seconds": pipeline.planned_bubble_seconds,
                "compute_scale": pipeline.compute_scale,
                "measured_bubble_seconds": float(np.median(rs.us(BUBBLE))) / 1e6,
                "measured_share_of_step": measured_s / step_s,
                "plan_bubble_fraction": plan.bubble_fraction,
                "excess_seconds": excess_s,
                "share_of_step": share,
            },
            suspects=(ctx.suspect(worst),),
            cost_seconds_per_step=excess_s,
        )
    ]


def _between_steps(ctx: _Context) -> list[Finding]:
    """A rank that spends much longer than its peers between two steps (eval, checkpoint, logging outside a step).

    That time is in no step's breakdown, but the other ranks wait for the rank, in their next collective or in the
    collectives they run between the steps too (an evaluation's metric all-reduce on every rank, a barrier): the
    cost table charges the first, and only this finding says why. Per rank-step, the rank's own time since its
    previous step ended (``gap_before_us`` less the time it was blocked in collectives there, ``between_steps.comm``:
    a rank waiting for a slow peer's evaluation is not slow itself) against the median of the same step's other
    ranks; rank-steps above the cost floor and :data:`NOISE_SIGMAS` x the gaps' spread, amortised over the rank's
    steps, must stand out from the median rank's by :data:`TRANSIENT_MIN_SHARE` of the step (a pair:
    :data:`PAIR_TRANSIENT_MIN_SHARE`) and, unless its long gaps recur in :data:`PAIR_MIN_STRETCHES` separate stretches
    (and number :data:`CONTENDED_MIN_SLOW_STEPS` at least on a contended run), by :data:`STEP_JITTER_SIGMAS` x the
    run's jitter; at most half of the ranks (a whole job that pauses between steps waits for nobody). Its cost is
    that amortised lateness.
    """
    rs = ctx.rs
    s = rs.breakdown.table.steps
    blocked = np.clip(s.between_comm_us, 0, None)  # -1: not measured, none taken out
    own = np.where(s.gap_before_us >= 0, s.gap_before_us - np.minimum(blocked, np.clip(s.gap_before_us, 0, None)), -1)
    # a gap that holds a save is checkpoint-stall's (the slowest saver, amortised): one finding per cause
    gap = np.where(between_checkpoint_us(rs) > 0, -1, own).astype(np.float64)
    known = gap >= 0
    if np.count_nonzero(known) < 2:  # one rank-step has nobody to be compared with
        return []
    typical = np.full(gap.shape, np.nan)
    typical[known] = median_of_others(rs.step_index[known], gap[known], rs.n_steps)
    compared = known & np.isfinite(typical)
    excess = np.where(compared, gap - np.nan_to_num(typical), 0.0)
    floor = max(MIN_COST_SHARE * ctx.step_us, NOISE_SIGMAS * _robust_sigma(excess[compared]))
    long = compared & (excess >= floor)
    if not long.any():
        return []
    amortised = np.bincount(rs.rank_index[long], weights=excess[long], minlength=rs.n_ranks) / rs.steps_per_rank
    # As for transient stragglers: it must cost a share of the step and stand out from the other ranks' own gaps; and
    # it must exceed the run's step-to-step jitter (a scheduler hiccup on shared cores is one long gap on a random
    # rank) unless its long gaps recur, apart, as a log flush or an evaluation every N steps does (a burst is the
    # host's; an amortised cost held to the per-step jitter missed a 50 ms flush every 10 steps on a 25 ms step).
    # The spread is the other ranks' (those under the bar): of two ranks, the robust spread of both is half their gap,
    # which 6 of them never exceed; a pair is held to the bar a transient straggler of a pair is held to instead.
    bar = TRANSIENT_MIN_SHARE * ctx.step_us
    if rs.n_ranks == 2:  # a pair
        bar = max(bar, PAIR_TRANSIENT_MIN_SHARE * ctx.step_us)
    over = amortised - median_rank_value(amortised)
    recurring = _stretches(rs.step_index[long], rs.rank_index[long], rs.n_ranks) >= PAIR_MIN_STRETCHES
    if ctx.contention is not None:
        recurring &= np.bincount(rs.rank_index[long], minlength=rs.n_ranks) >= CONTENDED_MIN_SLOW_STEPS
    above = (over >= bar) & (recurring | (over >= STEP_JITTER_SIGMAS * ctx.step_jitter_us))
    stands_out = above & (over >= NOISE_SIGMAS * _robust_sigma(amortised[~above]))
    ranks = np.flatnonzero(stands_out)
    if ranks.size == 0 or 2 * ranks.size > rs.n_ranks:
        return []
    findings = []
    peer_blocked = median_of_others(rs.step_index, blocked.astype(np.float64), rs.n_steps)
    for i in ranks[np.argsort(-amortised[ranks])][:MAX_STRAGGLER_FINDINGS].tolist():
        mine = long & (rs.rank_index == i)
        # What it costs: how late its long gaps made it, amortised (the others wait that long in their next
        # collective, or in their own collectives between the steps); the sync wait the table charges it may hold
        # other waits too, and is quoted beside.
        caused = wait_caused(rs, i, int(np.argmax(rs.caused_per_step_us[i])))
        cost_s = float(amortised[i]) / 1e6
        share = ctx.share(cost_s)
        full = s.gap_before_us[mine].astype(np.float64)  # as measured, its own time blocked there included
        gap_s = float(np.median(full)) / 1e6
        peers_s = float(np.median(typical[mine])) / 1e6
        peers_wait_s = float(np.median(np.nan_to_num(peer_blocked[mine]))) / 1e6
        # the others wait between the steps too where their collectives there hold most of its lateness
        there = peers_wait_s >= STRAGGLER_EXPLAINS * float(np.median(excess[mine])) / 1e6
        n_long, total = int(np.count_nonzero(mine)), int(rs.steps_per_rank[i])
        message = (
            f"{ctx.where(i)} spends {human_seconds(gap_s)} between steps before {n_long} of its {total} steps "
            f"({', '.join(_gap_parts(s.between_us[mine], full))}) {_peers_between(peers_s, peers_wait_s, there)}"
            f"it costs about {human_seconds(cost_s)} per step ({percent(share)} of the step, amortised)"
        )
        if caused is not None and not there:  # where they waited between the steps, the table holds none of it
            message += f"; the cost table: {caused.sentence()}"
        message += (
            "; give every rank the same evaluation work (as many batches, as long) or evaluate less often to stop the "
            "others waiting"
            if there
            else "; run eval, checkpoints and logging inside a step (a tracker phase) to see them in the table, and "
            "make them asynchronous or less frequent to stop the others waiting"
        )
        findings.append(
            Finding(
                code="between-steps",
                severity=severity_for(share),
                message=message,
                evidence={
                    "rank": int(rs.ranks[i]),
                    "gap_seconds": gap_s,
                    "peer_gap_seconds": peers_s,
                    "peer_wait_between_steps_seconds": peers_wait_s,
                    "steps_with_long_gap": n_long,
                    "steps": total,
                    "amortised_excess_seconds_per_step": float(amortised[i]) / 1e6,
                    "cost_seconds_per_step": cost_s,
                    "wait_per_member_seconds_per_step": None if caused is None else caused.per_member_seconds,
                    "share_of_step": share,
                },
                suspects=(ctx.suspect(i),),
                cost_seconds_per_step=cost_s,
            )
        )
    return findings


def _gap_parts(between_us: NDArray[np.int64], gap_us: NDArray[np.float64]) -> list[str]:
    """``eval 90.00 ms``, ..., ``unlabelled 11.00 ms``: each kind's median over the gaps (if above 0), the rest's."""
    between = between_us.astype(np.float64)
    labelled = between >= 0
    parts = []
    for k, kind in enumerate(BETWEEN_KINDS):
        typical = float(np.median(np.where(labelled[:, k], between[:, k], 0.0)))
        if typical > 0:  # a kind in one long gap of nine is not what they are spent on ("data 0 s")
            parts.append(f"{kind} {human_seconds(typical / 1e6)}")
    rest = np.clip(gap_us - np.where(labelled, between, 0.0).sum(axis=1), 0, None)
    parts.append(f"unlabelled {human_seconds(float(np.median(rest)) / 1e6)}")
    return parts


def _peers_between(peers_s: float, peers_wait_s: float, there: bool) -> str:  # noqa: FBT001 - a sentence's two forms
    """Where the other ranks wait for a rank late out of the time between steps: in collectives there, or next."""
    if there:
        return (
            f"where the other ranks spend {human_seconds(peers_s)} of their own and wait for it "
            f"{human_seconds(peers_wait_s)} in collectives between the steps (an evaluation's metric all-reduce or "
            "gather, a barrier): that time is outside every step, so no step's breakdown shows it; "
        )
    return (
        f"where the other ranks spend {human_seconds(peers_s)}: that time is outside every step, so no step's "
        "breakdown shows it, but the others wait for it in their next collective; "
    )


def _data_starved(ctx: _Context) -> list[Finding]:
    rs = ctx.rs
    data = rs.us(DATA)
    k = CATEGORY_INDEX[DATA]
    # Job-wide: the median rank's own typical wait (its median over its steps; with 2 ranks the one that waits less),
    # so that one slow loader beside healthy ones is no starvation of the job but the straggler in data loading it is.
    median_s = median_rank_value(grouped_median(rs.rank_index, data, rs.n_ranks)) / 1e6
    share = ctx.share(median_s)
    if share < DATA_MIN_SHARE:
        return []
    worst = int(np.argmax(rs.rank_mean_us[:, k]))
    starved = float(np.mean(rs.rank_mean_us[:, k] >= DATA_MIN_SHARE * ctx.step_us))
    message = (
        f"the data loader starves the job: the median rank waits {human_seconds(median_s)} per step for data "
        f"({percent(share)} of the step; {percent(starved)} of ranks wait over {percent(DATA_MIN_SHARE)}); worst "
        f"{ctx.where(worst)} at {human_seconds(float(rs.rank_mean_us[worst, k]) / 1e6)}: more loader workers, "
        f"prefetching or faster storage"
    )
    return [
        Finding(
            code="data-loader-starved",
            severity=severity_for(share),
            message=message,
            evidence={
                "median_data_wait_seconds": median_s,
                "p95_data_wait_seconds": float(np.percentile(data, 95)) / 1e6,
                "worst_rank": int(rs.ranks[worst]),
                "worst_data_wait_seconds": float(rs.rank_mean_us[worst, k]) / 1e6,
                "ranks_starved_fraction": starved,
                "share_of_step": share,
            },
            suspects=(ctx.suspect(worst),),
            cost_seconds_per_step=median_s,
        )
    ]


_BETWEEN_CHECKPOINT = BETWEEN_KINDS.index("checkpoint")


SAVER_SHARE = 0.25
"""A rank saves a checkpoint where its median save takes at least this share of the slowest saver's; a rank with
less only takes part in it (FSDP's full state dict gathered on every rank for rank 0 to write: 2.7 ms of one rank's
own beside rank 0's 314 ms, which a median over both ranks' saves read as 158 ms a save)."""


def between_checkpoint_us(rs: RankSteps) -> NDArray[np.float64]:
    """Each rank-step's checkpoint time before it, between steps (``between_steps.checkpoint``; 0 where unknown)."""
    between = rs.breakdown.table.steps.between_us[:, _BETWEEN_CHECKPOINT].astype(np.float64)
    return np.where(between > 0, between, 0.0)


def _checkpoint(ctx: _Context) -> list[Finding]:
    """The slowest saver's checkpoint time, amortised: inside its steps and between them (a Trainer saves there)."""
    rs = ctx.rs
    before = between_checkpoint_us(rs)
    ckpt = rs.us(CHECKPOINT) + before
    per_rank = np.bincount(rs.rank_index, weights=ckpt, minlength=rs.n_ranks) / np.maximum(rs.steps_per_rank, 1)
    # The slowest saver's amortised time: ranks that do not save wait for it in their next collective.
    worst = int(np.argmax(per_rank))
    amortised_s = float(per_rank[worst]) / 1e6
    share = ctx.share(amortised_s)
    if share < CHECKPOINT_MIN_SHARE:
        return []
    saving = ckpt > 0
    steps_with = int(np.unique(rs.step_index[saving]).size)
    # Each rank's own median save; a saver takes a share of the slowest's, the others only take part (a sharded
    # model's state-dict gather, rank 0 alone writing it: their time is the gather's, their waiting not counted).
    per_save = np.nan_to_num(grouped_median(rs.rank_index[saving], ckpt[saving], rs.n_ranks))
    savers = np.flatnonzero(per_save >= SAVER_SHARE * per_save[worst])
    part = np.flatnonzero((per_save > 0) & (per_save < SAVER_SHARE * per_save[worst]))
    per_save_s = median_rank_value(per_save[savers]) / 1e6
    outside = float(before.sum()) / float(ckpt.sum()) if ckpt.sum() > 0 else 0.0
    where = ""
    if outside >= 0.5:  # most of it
        where = " (between steps: outside every step's breakdown, the others wait for it in their next collective)"
    taking_part = ""
    if part.size:
        most = human_seconds(float(per_save[part].max()) / 1e6)
        taking_part = f", {part.size} more take{'s' * (part.size == 1)} part for at most {most} a save"
    message = (
        f"checkpointing stalls training: {steps_with} of {rs.n_steps} steps save a checkpoint on {savers.size} of "
        f"{rs.n_ranks} ranks, {human_seconds(per_save_s)} each (median saver){taking_part}{where}, "
        f"{human_seconds(amortised_s)} per step amortised on the slowest, {ctx.where(worst)} ({percent(share)} of the "
        "step; ranks that do not save wait for it): save asynchronously or less often"
    )
    return [
        Finding(
            code="checkpoint-stall",
            severity=severity_for(share),
            message=message,
            evidence={
                "amortised_seconds_per_step": amortised_s,
                "seconds_per_checkpoint": per_save_s,
                "steps_with_checkpoint": steps_with,
                "steps": rs.n_steps,
                "worst_rank": int(rs.ranks[worst]),
                "ranks_saving": int(savers.size),
                "ranks_taking_part": int(part.size),
                "share_of_step": share,
            },
            suspects=(ctx.suspect(worst),),
            cost_seconds_per_step=amortised_s,
        )
    ]

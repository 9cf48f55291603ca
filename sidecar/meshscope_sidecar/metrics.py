"""The sidecar's exported metrics, as data: name, type, unit, labels, help and where each comes from.

Like dcgm-exporter's ``etc/default-counters.csv``, the list is data, not code scattered over collectors: the
collector exports only what is listed here, ``docs/metrics.md`` is generated from it (``tests/sidecar`` checks that
the page matches), and the recording rules and the dashboard may use only these names. Names follow Prometheus'
conventions (``meshscope_`` prefix, base units in the name: ``_seconds``, ``_bytes``, ``_ratio`` for 0-1,
``_total`` on counters). Labels are bounded by construction: rank coordinates (:data:`RANK_LABELS`) plus each
metric's own closed set (axis, op, category, source, device, port); never step numbers, kernel names or comm
pointers.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import yaml


class MetricType(StrEnum):
    """Prometheus metric types the sidecar exports."""

    COUNTER = "counter"
    GAUGE = "gauge"


RANK_LABELS: tuple[str, ...] = (
    "job",
    "rank",
    "dp",
    "tp",
    "pp",
    "cp",
    "ep",
    "node",
    "nvlink_domain",
    "network_tier",
    "gpu",
)
"""Labels every per-rank series carries (:func:`~meshscope_sidecar.tagging.tag`), in this order."""

NODE_LABELS: tuple[str, ...] = ("job", "node", "nvlink_domain", "network_tier")
"""Labels of node-level series (network ports, the sidecar's own health)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class MetricSpec:
    """One exported metric."""

    name: str
    """Prometheus name; counters end in ``_total`` (the exposition name, as client_python's ``CounterMetricFamily``
    takes it without the suffix: see :attr:`family`)."""
    type: MetricType
    """Counter or gauge."""
    unit: str
    """Base unit in words (``seconds``, ``bytes``, ``bytes per second``, ``ratio``, ``1`` for counts)."""
    scope: str
    """``rank`` (carries :data:`RANK_LABELS`) or ``node`` (carries :data:`NODE_LABELS`)."""
    labels: tuple[str, ...]
    """The metric's own labels beyond the scope's, each from a closed set."""
    source: str
    """Which source produces it (``train_events``, ``dcgm``, ``nvml``, ``nccl_log``, ``infiniband``, ``sidecar``);
    ``dcgm|nvml`` means either."""
    help: str
    """One line: what it measures, in the metric's unit."""

    @property
    def family(self) -> str:
        """The name without ``_total`` (what ``CounterMetricFamily`` wants)."""
        return self.name.removesuffix("_total") if self.type is MetricType.COUNTER else self.name


def _m(  # noqa: PLR0917 - one short positional row per metric keeps the table readable
    name: str, type_: MetricType, unit: str, scope: str, labels: tuple[str, ...], source: str, help_: str
) -> MetricSpec:
    return MetricSpec(name=name, type=type_, unit=unit, scope=scope, labels=labels, source=source, help=help_)


C, G = MetricType.COUNTER, MetricType.GAUGE

METRICS: tuple[MetricSpec, ...] = (
    # --- the training loop (step records), per rank; the sidecar's own breakdown of them -------------------------
    _m("meshscope_steps_total", C, "1", "rank", (), "train_events", "Training steps recorded."),
    _m(
        "meshscope_step_seconds_total",
        C,
        "seconds",
        "rank",
        (),
        "train_events",
        "Wall time of the recorded steps, summed; rate over meshscope_steps_total is the mean step time.",
    ),
    _m("meshscope_last_step_seconds", G, "seconds", "rank", (), "train_events", "Wall time of the latest step."),
    _m(
        "meshscope_breakdown_seconds_total",
        C,
        "seconds",
        "rank",
        ("category", "axis"),
        "train_events",
        "Step time by breakdown category (compute, exposed_comm per axis, bubble, data, optimizer, checkpoint, "
        "other), summed over steps; the categories add up to meshscope_step_seconds_total.",
    ),
    _m(
        "meshscope_own_seconds_total",
        C,
        "seconds",
        "rank",
        (),
        "train_events",
        "The rank's own time (step time minus exposed communication and bubble), summed over steps: what the "
        "straggler gap compares.",
    ),
    _m(
        "meshscope_collective_bytes_total",
        C,
        "bytes",
        "rank",
        ("axis", "op"),
        "train_events",
        "Bytes per GPU moved by the rank's collectives and sends, by axis and operation.",
    ),
    _m(
        "meshscope_collectives_total",
        C,
        "1",
        "rank",
        ("axis", "op"),
        "train_events",
        "Collectives and sends issued by the rank, by axis and operation.",
    ),
    _m("meshscope_data_tokens_total", C, "1", "rank", (), "train_events", "Tokens the rank's batches held."),
    _m(
        "meshscope_data_longest_sequence_tokens",
        G,
        "tokens",
        "rank",
        (),
        "train_events",
        "Longest sequence in the rank's latest batch.",
    ),
    _m(
        "meshscope_data_attention_work_total",
        C,
        "tokens squared",
        "rank",
        (),
        "train_events",
        "Attention work of the rank's batches (sum over sequences of length squared).",
    ),
    _m(
        "meshscope_data_attention_seconds_total",
        C,
        "seconds",
        "rank",
        (),
        "train_events",
        "Time in attention kernels, as the SDK measured it.",
    ),
    _m(
        "meshscope_peak_memory_bytes",
        G,
        "bytes",
        "rank",
        (),
        "train_events",
        "Peak device memory allocated in the rank's latest step.",
    ),
    _m(
        "meshscope_records_dropped_total",
        C,
        "1",
        "rank",
        (),
        "train_events",
        "Step records the rank's SDK could not send (socket full or absent), as the SDK counts them.",
    ),
    _m(
        "meshscope_records_rejected_total",
        C,
        "1",
        "node",
        ("reason",),
        "train_events",
        "Step records received but not kept, by reason: foreign_rank (a rank that does not run on this pod), "
        "foreign_job, duplicate (a rank-step at or before one the same process of the rank sent already).",
    ),
    # --- GPUs (dcgm-exporter or NVML), per rank --------------------------------------------------------------------
    # gpu_instance: the MIG GPU instance id (dcgm-exporter's GPU_I_ID) of a series about one MIG instance, "" for a
    # whole GPU; at most 7 per GPU, so bounded.
    _m(
        "meshscope_gpu_utilization_ratio",
        G,
        "ratio",
        "rank",
        ("gpu_instance",),
        "dcgm|nvml",
        "Reported GPU utilisation (DCGM GPU_UTIL / NVML utilization.gpu), 0-1: a spinning NCCL kernel counts as busy.",
    ),
    _m(
        "meshscope_gpu_engine_active_ratio",
        G,
        "ratio",
        "rank",
        ("gpu_instance",),
        "dcgm",
        "Fraction of time the graphics/compute engine was active (DCGM PROF_GR_ENGINE_ACTIVE), 0-1: the profiling "
        "field dcgm-exporter's default counters export (SM_ACTIVE is commented out there).",
    ),
    _m(
        "meshscope_gpu_sm_active_ratio",
        G,
        "ratio",
        "rank",
        ("gpu_instance",),
        "dcgm",
        "Fraction of time at least one warp was resident per SM, averaged over SMs (DCGM PROF_SM_ACTIVE), 0-1.",
    ),
    _m(
        "meshscope_gpu_tensor_active_ratio",
        G,
        "ratio",
        "rank",
        ("gpu_instance",),
        "dcgm",
        "Fraction of cycles the tensor pipes were active (DCGM PROF_PIPE_TENSOR_ACTIVE), 0-1.",
    ),
    _m(
        "meshscope_gpu_dram_active_ratio",
        G,
        "ratio",
        "rank",
        ("gpu_instance",),
        "dcgm",
        "Fraction of cycles device memory was busy (DCGM PROF_DRAM_ACTIVE), 0-1.",
    ),
    _m("meshscope_gpu_memory_used_bytes", G, "bytes", "rank", ("gpu_instance",), "dcgm|nvml", "Device memory in use."),
    _m("meshscope_gpu_memory_total_bytes", G, "bytes", "rank", ("gpu_instance",), "dcgm|nvml", "Device memory size."),
    _m(
        "meshscope_gpu_nvlink_transmit_bytes_per_second",
        G,
        "bytes per second",
        "rank",
        ("gpu_instance",),
        "dcgm",
        "NVLink bytes sent per second (DCGM PROF_NVLINK_TX_BYTES, a rate).",
    ),
    _m(
        "meshscope_gpu_nvlink_receive_bytes_per_second",
        G,
        "bytes per second",
        "rank",
        ("gpu_instance",),
        "dcgm",
        "NVLink bytes received per second (DCGM PROF_NVLINK_RX_BYTES, a rate).",
    ),
    _m(
        "meshscope_gpu_pcie_transmit_bytes_per_second",
        G,
        "bytes per second",
        "rank",
        ("gpu_instance",),
        "dcgm",
        "PCIe bytes sent per second (DCGM PROF_PCIE_TX_BYTES, a rate).",
    ),
    _m(
        "meshscope_gpu_pcie_receive_bytes_per_second",
        G,
        "bytes per second",
        "rank",
        ("gpu_instance",),
        "dcgm",
        "PCIe bytes received per second (DCGM PROF_PCIE_RX_BYTES, a rate).",
    ),
    _m("meshscope_gpu_power_watts", G, "watts", "rank", ("gpu_instance",), "dcgm|nvml", "Board power draw."),
    _m("meshscope_gpu_sm_clock_hertz", G, "hertz", "rank", ("gpu_instance",), "dcgm|nvml", "SM clock."),
    _m(
        "meshscope_gpu_temperature_celsius",
        G,
        "degrees Celsius",
        "rank",
        ("gpu_instance",),
        "dcgm|nvml",
        "GPU temperature.",
    ),
    _m(
        "meshscope_gpu_xid_errors_total",
        C,
        "1",
        "rank",
        ("gpu_instance",),
        "dcgm",
        "XID errors seen since the sidecar started (DCGM XID_ERRORS changes).",
    ),
    # --- NCCL's debug log, per rank ------------------------------------------------------------------------------
    _m(
        "meshscope_nccl_collectives_total",
        C,
        "1",
        "rank",
        ("axis", "op"),
        "nccl_log",
        "NCCL calls logged (COLL lines), by the axis of their communicator and operation.",
    ),
    _m(
        "meshscope_nccl_bytes_total",
        C,
        "bytes",
        "rank",
        ("axis", "op"),
        "nccl_log",
        "Message bytes of the logged NCCL calls (count x datatype size; AllGather and ReduceScatter per rank).",
    ),
    _m(
        "meshscope_nccl_communicators",
        G,
        "1",
        "rank",
        ("axis",),
        "nccl_log",
        "Communicators the rank belongs to, by the axis their members map to (axis 'unknown' when none fits).",
    ),
    _m(
        "meshscope_nccl_inspector_collectives_total",
        C,
        "1",
        "rank",
        ("axis", "op"),
        "nccl_log",
        "NCCL calls NCCL Inspector recorded (its JSON lines), by the axis of their communicator and operation.",
    ),
    _m(
        "meshscope_nccl_inspector_bytes_total",
        C,
        "bytes",
        "rank",
        ("axis", "op"),
        "nccl_log",
        "Message bytes of the calls NCCL Inspector recorded (coll_msg_size_bytes / p2p_msg_size_bytes).",
    ),
    _m(
        "meshscope_nccl_inspector_exec_seconds_total",
        C,
        "seconds",
        "rank",
        ("axis", "op"),
        "nccl_log",
        "Execution time of the calls NCCL Inspector recorded (coll_exec_time_us, GPU-timed by default), summed.",
    ),
    # --- the network (InfiniBand / RoCE sysfs counters), per port ------------------------------------------------
    _m(
        "meshscope_network_transmit_bytes_per_second",
        G,
        "bytes per second",
        "node",
        ("device", "port", "rail_gpu"),
        "infiniband",
        "Bytes sent per second on the port (port_xmit_data x 4, between two polls).",
    ),
    _m(
        "meshscope_network_receive_bytes_per_second",
        G,
        "bytes per second",
        "node",
        ("device", "port", "rail_gpu"),
        "infiniband",
        "Bytes received per second on the port (port_rcv_data x 4, between two polls).",
    ),
    _m(
        "meshscope_network_transmit_packets_per_second",
        G,
        "packets per second",
        "node",
        ("device", "port", "rail_gpu"),
        "infiniband",
        "Packets sent per second on the port (port_xmit_packets, between two polls).",
    ),
    _m(
        "meshscope_network_receive_packets_per_second",
        G,
        "packets per second",
        "node",
        ("device", "port", "rail_gpu"),
        "infiniband",
        "Packets received per second on the port (port_rcv_packets, between two polls).",
    ),
    _m(
        "meshscope_network_transmit_wait_ticks_total",
        C,
        "ticks",
        "node",
        ("device", "port", "rail_gpu"),
        "infiniband",
        "Ticks during which the port had data to send but sent none (port_xmit_wait), since the sidecar started. "
        "Kept in ticks, as node_exporter does: the tick length is not in the kernel ABI and depends on the adapter "
        "generation (NVIDIA/ib-traffic-monitor#3), so no ratio of time can be derived from sysfs alone.",
    ),
    _m(
        "meshscope_network_link_rate_bytes_per_second",
        G,
        "bytes per second",
        "node",
        ("device", "port", "rail_gpu"),
        "infiniband",
        "Signalling rate of the port's link (the port's rate file, Gb/s x 125,000,000).",
    ),
    _m(
        "meshscope_network_port_active",
        G,
        "1",
        "node",
        ("device", "port", "rail_gpu"),
        "infiniband",
        "1 when the port's logical state is ACTIVE, 0 otherwise (DOWN, INIT, ARMED).",
    ),
    _m(
        "meshscope_network_errors_total",
        C,
        "1",
        "node",
        ("device", "port", "rail_gpu", "counter"),
        "infiniband",
        "Error counters of the port (symbol_error, port_rcv_errors, link_downed, ...), by counter.",
    ),
    _m(
        "meshscope_network_congestion_total",
        C,
        "1",
        "node",
        ("device", "port", "rail_gpu", "counter"),
        "infiniband",
        "RoCE congestion notifications (hw_counters np_cnp_sent, rp_cnp_handled, np_ecn_marked_roce_packets).",
    ),
    # --- the sidecar itself ----------------------------------------------------------------------------------------
    _m(
        "meshscope_source_up",
        G,
        "1",
        "node",
        ("source",),
        "sidecar",
        "1 when the source's last poll read its input, 0 otherwise (absent input, no GPU, exporter down).",
    ),
    _m(
        "meshscope_source_parse_errors_total",
        C,
        "1",
        "node",
        ("source",),
        "sidecar",
        "Input the source could not read and skipped (lines, datagrams, series).",
    ),
    _m(
        "meshscope_source_dropped_total",
        C,
        "1",
        "node",
        ("source",),
        "sidecar",
        "Readings the source lost because a bounded buffer was full.",
    ),
    _m(
        "meshscope_source_poll_seconds_total",
        C,
        "seconds",
        "node",
        ("source",),
        "sidecar",
        "CPU time the sidecar's polling thread spent on the source: its own overhead, per source.",
    ),
    _m(
        "meshscope_sidecar_untagged_series",
        G,
        "1",
        "node",
        ("source", "reason"),
        "sidecar",
        "Series a source holds that the sidecar does not export because it cannot tag them, by reason "
        "(foreign_rank, foreign_gpu, ranks_unknown in degraded mode, bad_labels, unknown_metric, no_subject, "
        "duplicate_series): never exported with a wrong label.",
    ),
    _m(
        "meshscope_sidecar_info",
        G,
        "1",
        "node",
        ("version", "mode"),
        "sidecar",
        "Always 1; the sidecar's version and identity mode (full, or degraded when ranks cannot be tagged).",
    ),
)
"""Every metric the sidecar exports, in the order ``docs/metrics.md`` lists them."""

BY_NAME: dict[str, MetricSpec] = {m.name: m for m in METRICS}
""":data:`METRICS` by name."""

BREAKDOWN_CATEGORIES: tuple[str, ...] = (
    "compute",
    "exposed_comm",
    "bubble",
    "data",
    "optimizer",
    "checkpoint",
    "other",
)
"""Values of ``category`` on ``meshscope_breakdown_seconds_total`` (``axis`` is set on ``exposed_comm`` only, empty
otherwise): the categories of DESIGN.md's breakdown that need no other node."""

LABEL_HELP: dict[str, str] = {
    "job": "The training job's name (the TrainingJob, or `meshscope run`'s job name).",
    "rank": "Global rank of the GPU's process.",
    "dp": "Index on the data-parallel axis.",
    "tp": "Index on the tensor-parallel axis.",
    "pp": "Index on the pipeline-parallel axis: the pipeline stage.",
    "cp": "Index on the context-parallel axis.",
    "ep": "Index on the expert-parallel axis (carved out of dp x cp).",
    "node": "Kubernetes node name (downward API), or the host name.",
    "nvlink_domain": "NVLink domain of the node (`nvidia.com/gpu.clique`, or the placement file); empty when unknown.",
    "network_tier": "Network block of the node (topograph's tier labels, or the placement file); empty when unknown.",
    "gpu": "Local GPU index on the node (nvidia-smi order, dcgm-exporter's `gpu`).",
    "category": "Breakdown category: " + ", ".join(f"`{c}`" for c in BREAKDOWN_CATEGORIES) + ".",
    "axis": "Parallelism axis (`dp`, `tp`, `pp`, `cp`, `ep`); for an NCCL communicator also `world` (every rank), "
    "`dp-cp` (dp x cp) or `edp` (expert data parallel), and `unknown` when its members fit no group; empty on "
    "categories other than `exposed_comm`.",
    "op": "Collective or point-to-point operation (`all_reduce`, `all_gather`, `reduce_scatter`, `all_to_all`, "
    "`broadcast`, `send`, `recv`, ...).",
    "source": "The sidecar's input: `train_events`, `dcgm`, `nvml`, `nccl_log`, `infiniband`.",
    "device": "InfiniBand / RoCE device (`mlx5_0`, ...).",
    "port": "Port number of the device.",
    "rail_gpu": "Local GPU index whose rail the port serves; empty when the mapping is unknown.",
    "counter": "Name of the sysfs counter (`symbol_error`, `np_cnp_sent`, ...).",
    "version": "The sidecar's version.",
    "mode": "`full`, or `degraded` when the sidecar cannot tag samples with ranks.",
    "gpu_instance": "MIG GPU instance id (dcgm-exporter's `GPU_I_ID`) of a series about one MIG instance; empty for a "
    "whole GPU (at most 7 per GPU).",
    "reason": "Why input was not kept or not exported, from a closed set named in the metric's help (`foreign_rank`, "
    "`foreign_job`, `duplicate`, `foreign_gpu`, `ranks_unknown`, ...).",
}
"""What each label means: the rank and node labels and every metric's own labels (``docs/metrics.md``)."""


# ---- docs/metrics.md ----------------------------------------------------------------------------------------------

_RECORD_LINE = re.compile(r"""^\s*- record:\s*(?P<q>["']?)(?P<record>[^"'\s]+)(?P=q)\s*$""")
_COMMENT_LINE = re.compile(r"^\s*#\s?(?P<text>.*)$")


@dataclass(frozen=True, slots=True, kw_only=True)
class RecordingRule:
    """One recording rule of ``sidecar/monitoring/recording-rules.yaml``, as ``docs/metrics.md`` lists it."""

    group: str
    """The rule group's name."""
    record: str
    """The recorded series' name (``level:metric:operations``)."""
    expr: str
    """The PromQL expression."""
    meaning: str
    """What the series means: the comment lines just above ``- record:`` in the file, joined."""

    @property
    def kept_labels(self) -> tuple[str, ...]:
        """The labels the rule keeps, read from the name's level (``job_pp`` -> ``job, pp``).

        A per-rank rule's level starts with ``rank``: it keeps every label of the rank, and the rest of its level
        names the metric's own labels (``rank_category_axis``).
        """
        return tuple(self.record.split(":", 1)[0].split("_"))

    @property
    def per_rank(self) -> bool:
        """Whether the rule records one series per rank (level ``rank...``) rather than an aggregate."""
        return self.kept_labels[0] == "rank"


class RulesFileError(ValueError):
    """A recording-rules file that is not a Prometheus rule file, or a rule without a comment saying what it means."""


def _meanings(text: str) -> dict[str, str]:
    """Record name -> the comment lines just above its ``- record:`` line, at its indentation, joined.

    A ``#`` line at another indentation (inside an expression's block scalar, a header) is not the rule's comment.
    """
    meanings: dict[str, str] = {}
    comment: list[tuple[int, str]] = []
    for line in text.splitlines():
        indent = len(line) - len(line.lstrip())
        if m := _RECORD_LINE.match(line):
            own: list[str] = []
            for at, words in reversed(comment):
                if at != indent:
                    break
                own.insert(0, words)
            meanings[m["record"]] = " ".join(own)
        if m := _COMMENT_LINE.match(line):
            comment.append((indent, m["text"].strip()))
        else:
            comment = []
    return meanings


def _rule_groups(text: str) -> list[tuple[str, list[dict[str, object]]]]:
    """The file's groups as (name, rules), every group a mapping with a ``rules`` list of mappings."""
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise RulesFileError(f"not a Prometheus rule file: {e}") from e
    groups = doc.get("groups") if isinstance(doc, dict) else None
    if not isinstance(groups, list):
        raise RulesFileError("not a Prometheus rule file: no top-level 'groups' list")
    out = []
    for group in groups:
        rules = (group.get("rules") or []) if isinstance(group, dict) else None
        if not isinstance(rules, list) or not all(isinstance(r, dict) for r in rules):
            raise RulesFileError(f"not a rule group (a mapping with a 'rules' list of mappings): {str(group)[:80]}")
        out.append((str(group.get("name", "")), rules))
    return out


def read_recording_rules(text: str) -> tuple[RecordingRule, ...]:
    """Read a recording-rules file, with each rule's meaning from the comment lines just above its ``- record:``.

    Args:
        text: the file's text (Prometheus rule-file YAML).

    Returns:
        The recording rules in file order (alerting rules are skipped).

    Raises:
        RulesFileError: the file is not a rule file, or a recording rule has no comment saying what it means.
    """
    meanings = _meanings(text)
    out = []
    for group, rules in _rule_groups(text):
        for rule in rules:
            if "record" not in rule:
                continue  # an alerting rule
            record = str(rule["record"])
            if not meanings.get(record):
                raise RulesFileError(f"recording rule {record} has no comment above it saying what it means")
            out.append(
                RecordingRule(group=group, record=record, expr=str(rule.get("expr", "")), meaning=meanings[record])
            )
    return tuple(out)


def _cell(text: str) -> str:
    return text.replace("|", r"\|")


def _labels_cell(spec: MetricSpec) -> str:
    scope = "rank labels" if spec.scope == "rank" else "node labels"
    return ", ".join([scope, *(f"`{label}`" for label in spec.labels)])


def render_markdown(rules: tuple[RecordingRule, ...], *, rules_path: str) -> str:
    """``docs/metrics.md``: the labels, every metric of :data:`METRICS` and the recording rules, as Markdown.

    Args:
        rules: the recording rules (:func:`read_recording_rules`).
        rules_path: the rules file's path as the page names it (relative to the repository).

    Returns:
        The page, ending with a newline.

    Raises:
        ValueError: a label of :data:`METRICS` has no entry in :data:`LABEL_HELP`.
    """
    used = {*RANK_LABELS, *NODE_LABELS, *(label for m in METRICS for label in m.labels)}
    if missing := sorted(used - LABEL_HELP.keys()):
        raise ValueError(f"labels without a meaning in LABEL_HELP: {missing}")
    own_labels = sorted({label for m in METRICS for label in m.labels})
    out = [
        "# Metrics",
        "",
        (
            "<!-- Generated from meshscope_sidecar/metrics.py (METRICS, LABEL_HELP) and "
            f"{rules_path}: `python -m meshscope_sidecar.metrics {rules_path} > docs/metrics.md`. "
            "Do not edit by hand; tests/sidecar/test_metrics_doc.py checks that it matches. -->"
        ),
        "",
        (
            "What the meshscope sidecar exports on `/metrics`, and the recording rules shipped with it. Names follow "
            "Prometheus' conventions: the `meshscope_` prefix, base units in the name (`_seconds`, `_bytes`, `_ratio` "
            "for 0-1), `_total` on counters. Every label comes from a closed set: no step numbers, kernel names or "
            "communicator pointers. Scrape the sidecars with `honor_labels: true`, so that their `job` label (the "
            "training job) is kept."
        ),
        "",
        "## Labels",
        "",
        "Per-rank series carry the **rank labels**, in this order: " + ", ".join(f"`{x}`" for x in RANK_LABELS) + ".",
        "Node-level series (network ports, the sidecar itself) carry the **node labels**: "
        + ", ".join(f"`{x}`" for x in NODE_LABELS)
        + ".",
        "",
        "| label | meaning |",
        "|---|---|",
        *(f"| `{x}` | {_cell(LABEL_HELP[x])} |" for x in dict.fromkeys((*RANK_LABELS, *NODE_LABELS))),
        "",
        "The metrics' own labels:",
        "",
        "| label | meaning |",
        "|---|---|",
        *(f"| `{x}` | {_cell(LABEL_HELP[x])} |" for x in own_labels),
        "",
        "## Metrics",
        "",
        "| name | type | unit | labels | source | help |",
        "|---|---|---|---|---|---|",
        *(
            f"| `{m.name}` | {m.type} | {m.unit} | {_labels_cell(m)} | {_cell(m.source.replace('|', ' or '))} "
            f"| {_cell(m.help)} |"
            for m in METRICS
        ),
        "",
        "## Recording rules",
        "",
        (
            f"In `{rules_path}`. Names are `level:metric:operations`: the labels kept, the metric, what was done. "
            "Two levels. The **per-rank** rules (level `rank...`) compute every per-rank quantity once per evaluation "
            "from the sidecars' counters, as a ratio of two rates of the same rank (seconds per step, a share of step "
            "time), so it is exact whatever the store does at the window's edges and the same on Prometheus and "
            "VictoriaMetrics; they keep every label of the rank, so they record **one series per rank per metric** "
            "(per category and axis for the breakdown): bounded by the job's size, not by a closed set. The "
            "**aggregates** read only the per-rank series recorded earlier in their own group (on Prometheus the same "
            "evaluation: no lag; on vmalert, which writes through remote write, the previous one at best) and keep "
            "only closed-set labels. Windows are 5 minutes."
        ),
        "",
    ]
    for group in dict.fromkeys(r.group for r in rules):
        out += [f"### {group}", "", "| record | labels | meaning |", "|---|---|---|"]
        out += [f"| `{r.record}` | {_rule_labels_cell(r)} | {_cell(r.meaning)} |" for r in rules if r.group == group]
        out.append("")
    return "\n".join(out)


def _rule_labels_cell(rule: RecordingRule) -> str:
    if rule.per_rank:
        return ", ".join(["rank labels", *(f"`{x}`" for x in rule.kept_labels[1:])])
    return ", ".join(f"`{x}`" for x in rule.kept_labels)


def _main(argv: list[str]) -> int:
    """``python -m meshscope_sidecar.metrics RULES_FILE``: print ``docs/metrics.md``."""
    if len(argv) != 1:
        sys.stderr.write("usage: python -m meshscope_sidecar.metrics sidecar/monitoring/recording-rules.yaml\n")
        return 2
    path = Path(argv[0])
    sys.stdout.write(render_markdown(read_recording_rules(path.read_text()), rules_path=path.as_posix()))
    return 0


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))

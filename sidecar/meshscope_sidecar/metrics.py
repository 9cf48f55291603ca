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

from dataclasses import dataclass
from enum import StrEnum


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
        "foreign_job, duplicate (a rank-step at or before one the rank sent already).",
    ),
    # --- GPUs (dcgm-exporter or NVML), per rank --------------------------------------------------------------------
    _m(
        "meshscope_gpu_utilization_ratio",
        G,
        "ratio",
        "rank",
        (),
        "dcgm|nvml",
        "Reported GPU utilisation (DCGM GPU_UTIL / NVML utilization.gpu), 0-1: a spinning NCCL kernel counts as busy.",
    ),
    _m(
        "meshscope_gpu_sm_active_ratio",
        G,
        "ratio",
        "rank",
        (),
        "dcgm",
        "Fraction of time at least one warp was resident per SM, averaged over SMs (DCGM PROF_SM_ACTIVE), 0-1.",
    ),
    _m(
        "meshscope_gpu_tensor_active_ratio",
        G,
        "ratio",
        "rank",
        (),
        "dcgm",
        "Fraction of cycles the tensor pipes were active (DCGM PROF_PIPE_TENSOR_ACTIVE), 0-1.",
    ),
    _m(
        "meshscope_gpu_dram_active_ratio",
        G,
        "ratio",
        "rank",
        (),
        "dcgm",
        "Fraction of cycles device memory was busy (DCGM PROF_DRAM_ACTIVE), 0-1.",
    ),
    _m("meshscope_gpu_memory_used_bytes", G, "bytes", "rank", (), "dcgm|nvml", "Device memory in use."),
    _m("meshscope_gpu_memory_total_bytes", G, "bytes", "rank", (), "dcgm|nvml", "Device memory size."),
    _m(
        "meshscope_gpu_nvlink_transmit_bytes_per_second",
        G,
        "bytes per second",
        "rank",
        (),
        "dcgm",
        "NVLink bytes sent per second (DCGM PROF_NVLINK_TX_BYTES, a rate).",
    ),
    _m(
        "meshscope_gpu_nvlink_receive_bytes_per_second",
        G,
        "bytes per second",
        "rank",
        (),
        "dcgm",
        "NVLink bytes received per second (DCGM PROF_NVLINK_RX_BYTES, a rate).",
    ),
    _m(
        "meshscope_gpu_pcie_transmit_bytes_per_second",
        G,
        "bytes per second",
        "rank",
        (),
        "dcgm",
        "PCIe bytes sent per second (DCGM PROF_PCIE_TX_BYTES, a rate).",
    ),
    _m(
        "meshscope_gpu_pcie_receive_bytes_per_second",
        G,
        "bytes per second",
        "rank",
        (),
        "dcgm",
        "PCIe bytes received per second (DCGM PROF_PCIE_RX_BYTES, a rate).",
    ),
    _m("meshscope_gpu_power_watts", G, "watts", "rank", (), "dcgm|nvml", "Board power draw."),
    _m("meshscope_gpu_sm_clock_hertz", G, "hertz", "rank", (), "dcgm|nvml", "SM clock."),
    _m("meshscope_gpu_temperature_celsius", G, "degrees Celsius", "rank", (), "dcgm|nvml", "GPU temperature."),
    _m(
        "meshscope_gpu_xid_errors_total",
        C,
        "1",
        "rank",
        (),
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
        "meshscope_network_transmit_wait_ratio",
        G,
        "ratio",
        "node",
        ("device", "port", "rail_gpu"),
        "infiniband",
        "Share of time the port had data to send but could not (port_xmit_wait ticks against the link's tick rate).",
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

"""The operator's settings: one dataclass, built once from the environment in ``__main__`` and passed down.

Exists so that every knob of the operator (where the webhook server listens, its certificates, what the pod webhook
injects) has one name, one unit, one default and one place that checks it (:func:`settings_from`), as STYLE.md §4
asks. Every setting is an environment variable ``MESHSCOPE_OPERATOR_*`` (what the chart's Deployment sets). A bad
value is a :class:`SettingsError` naming the variable, its value and what would fit; the entry point prints it on one
line and exits non-zero.

It must not open files or sockets, and must not import kopf: kopf is configured from these values in the startup
handler (:mod:`~meshscope_operator.handlers`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Mapping

PREFIX = "MESHSCOPE_OPERATOR_"

DEFAULT_WEBHOOK_PORT = 9443
"""The port controller-runtime's webhook servers use by default (kubebuilder's ``webhook.Options.Port``)."""
DEFAULT_SIDECAR_PORT = 9402
"""The sidecar's default (``meshscope_sidecar.settings.DEFAULT_PORT``: next to dcgm-exporter's 9400)."""
DEFAULT_MASTER_PORT = 29500
"""torchrun's default rendezvous port (``torch.distributed.run``, ``--master-port``)."""
MAX_NETWORK_TIERS = 8
"""Most network tier labels, as the CRD bounds ``spec.topology.networkTierLabels``."""
MAX_ADMISSION_WARNINGS = 15
"""Most warnings one admission response may carry: the API server stops passing warnings on whole once they add up
to 4,096 characters and then cuts each to 256 (k8s.io/apiserver ``pkg/endpoints/filters/warning.go``:
``truncateAtTotalRunes = 4 * 1024``, ``truncateItemRunes = 256``); 15 of at most 256 plus one summary line fit."""

# A DNS-1123 label or subdomain (a namespace, a name) and a container image reference, loosely: what a typo looks
# like is caught, what Kubernetes itself accepts is not second-guessed.
_NAMESPACE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_IMAGE = re.compile(r"^[^\s]{1,512}$")
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|Ki|Mi|Gi|Ti)?$")
_PULL_POLICIES = ("Always", "IfNotPresent", "Never")
# A label key: an optional DNS-subdomain prefix and "/", then a name of at most 63 characters (the CRD's pattern).
_LABEL_KEY = re.compile(
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)
_URL = re.compile(r"^https?://[^\s/]+(/[^\s]*)?$")
_STORE_URL = re.compile(r"^https?://[^\s/?#]+(/[^\s?#]*)?$")
MiB = 1 << 20


class SettingsError(ValueError):
    """A setting that does not fit: names the variable, its value and what would fit."""


@dataclass(frozen=True, slots=True, kw_only=True)
class OperatorSettings:
    """Everything the operator is told. Build it with :func:`settings_from`."""

    namespaces: tuple[str, ...] = ()
    """Namespaces watched for TrainingJobs (``MESHSCOPE_OPERATOR_NAMESPACES``, comma-separated); empty (the
    default): every namespace (``kopf run -A``)."""
    peering: str = ""
    """kopf peering object (``MESHSCOPE_OPERATOR_PEERING``); empty (the default): standalone, one replica, which
    needs no ``KopfPeering`` CRD."""
    liveness_port: int = 8080
    """Port of kopf's liveness endpoint ``/healthz`` (``MESHSCOPE_OPERATOR_LIVENESS_PORT``); 0: none."""
    log_level: str = "info"
    """``debug``, ``info``, ``warning`` or ``error`` (``MESHSCOPE_OPERATOR_LOG_LEVEL``)."""

    webhook_addr: str = "0.0.0.0"  # noqa: S104 - the API server reaches the webhook through the pod's Service
    """Address the HTTPS webhook server listens on (``MESHSCOPE_OPERATOR_WEBHOOK_ADDR``); default all interfaces."""
    webhook_port: int = DEFAULT_WEBHOOK_PORT
    """Port of the webhook server (``MESHSCOPE_OPERATOR_WEBHOOK_PORT``), default 9443; 0 picks a free one (tests)."""
    webhook_host: str = ""
    """Host name the API server uses to reach the webhook, written into kopf-managed webhook configurations
    (``MESHSCOPE_OPERATOR_WEBHOOK_HOST``); empty: the listen address."""
    webhook_cert_file: str = "/etc/meshscope/webhook/tls.crt"
    """Server certificate, PEM (``MESHSCOPE_OPERATOR_WEBHOOK_CERT_FILE``): a Secret mounted by the chart,
    self-signed or cert-manager's; kopf re-reads it when it changes."""
    webhook_key_file: str = "/etc/meshscope/webhook/tls.key"
    """Its private key, PEM (``MESHSCOPE_OPERATOR_WEBHOOK_KEY_FILE``)."""
    webhook_ca_file: str = ""
    """CA bundle that signed the certificate (``MESHSCOPE_OPERATOR_WEBHOOK_CA_FILE``), the ``caBundle`` of kopf-managed
    configurations; empty: the certificate itself."""
    webhook_managed: str = ""
    """Name of the Validating/MutatingWebhookConfiguration kopf creates and keeps up to date
    (``MESHSCOPE_OPERATOR_WEBHOOK_MANAGED``); empty (the default): the chart installs them, kopf only serves."""
    max_warnings: int = 10
    """Planner findings returned as admission warnings, at most (``MESHSCOPE_OPERATOR_MAX_WARNINGS``, 1 to
    :data:`MAX_ADMISSION_WARNINGS`); the rest are summed up in one more line."""

    max_planned_gpus: int = 262_144
    """Largest job (GPUs) the TrainingJob webhook plans (``MESHSCOPE_OPERATOR_MAX_PLANNED_GPUS``); a larger one is
    loaded and checked but admitted unplanned, with a warning, so that a hostile or mistyped ``nodes`` cannot make
    the webhook run past the API server's timeout or the operator out of memory. Default 2^18 (planning it takes
    about 0.1 s)."""

    sidecar_image: str = "meshscope-sidecar:0.1.0"
    """Image of the injected sidecar (``MESHSCOPE_OPERATOR_SIDECAR_IMAGE``); the chart sets its own."""
    sidecar_image_pull_policy: str = "IfNotPresent"
    """``Always``, ``IfNotPresent`` or ``Never`` (``MESHSCOPE_OPERATOR_SIDECAR_IMAGE_PULL_POLICY``)."""
    sidecar_port: int = DEFAULT_SIDECAR_PORT
    """Port of the sidecar's ``/metrics``, ``/v1/steps``, ``/healthz`` (``MESHSCOPE_OPERATOR_SIDECAR_PORT``)."""
    sidecar_cpu_request: str = "100m"
    """CPU the sidecar requests (``MESHSCOPE_OPERATOR_SIDECAR_CPU_REQUEST``), a Kubernetes quantity."""
    sidecar_memory_request: str = "256Mi"
    """Memory it requests (``MESHSCOPE_OPERATOR_SIDECAR_MEMORY_REQUEST``)."""
    sidecar_memory_limit: str = "512Mi"
    """Memory limit (``MESHSCOPE_OPERATOR_SIDECAR_MEMORY_LIMIT``): the sidecar keeps at most 32 MiB of step records
    and 64 MiB of records waiting (sidecar/README.md, Limits), so 512 MiB leaves room for the interpreter."""
    dcgm_url: str = "http://$(MESHSCOPE_HOST_IP):9400/metrics"
    """dcgm-exporter's metrics URL as the sidecar should scrape it (``MESHSCOPE_OPERATOR_DCGM_URL``); the default
    is the DaemonSet's host port on the pod's node (``$(MESHSCOPE_HOST_IP)`` is the downward API's
    ``status.hostIP``, expanded by the kubelet); empty: no DCGM source."""
    nccl_debug_subsys: str = "INIT"
    """``NCCL_DEBUG_SUBSYS`` set in the training containers (``MESHSCOPE_OPERATOR_NCCL_DEBUG_SUBSYS``): what the
    sidecar's NCCL source parses. ``INIT``: communicator setup (ranks, topology, NVLink domains), a few lines per
    communicator. ``INIT,COLL`` adds one line per collective call (its count and bytes per rank): ~185 bytes each,
    which at a thousand collectives a second per rank fill a node's ephemeral storage in about a day (nothing
    rotates NCCL's files, and an ``emptyDir`` limit would evict the pod). Opt in for a run you debug; the SDK's
    records give every collective without it."""

    api_server: str = ""
    """URL of the Kubernetes API for reconcile's own requests (``MESHSCOPE_OPERATOR_API_SERVER``, ``http(s)://``);
    empty (the default): in the cluster, ``https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT`` with the
    pod's service account token and CA (kopf's own connection logs in the same way)."""
    master_port: int = DEFAULT_MASTER_PORT
    """``MASTER_PORT`` of the Jobs the operator makes (``MESHSCOPE_OPERATOR_MASTER_PORT``), default 29500, torchrun's
    own default (``torch.distributed.run --master-port``)."""
    nvlink_domain_label: str = "nvidia.com/gpu.clique"
    """Node label naming a node's NVLink domain (``MESHSCOPE_OPERATOR_NVLINK_DOMAIN_LABEL``); default GPU feature
    discovery's clique label. A TrainingJob's ``spec.topology.nvlinkDomainLabel`` overrides it for that job."""
    network_tier_labels: tuple[str, ...] = ("network.topology.nvidia.com/leaf", "network.topology.nvidia.com/spine")
    """Node labels naming the network switch at each tier, closest first (``MESHSCOPE_OPERATOR_NETWORK_TIER_LABELS``,
    comma-separated, at most 8); default topograph's. The first one a node has is its network block. A
    TrainingJob's ``spec.topology.networkTierLabels`` overrides them for that job."""
    # ---- the cost table's two tiers (docs/operator.md, "The cost table")
    metrics_url: str = ""
    """Base URL of the Prometheus-compatible store the continuous tier queries over ``/api/v1/query``
    (``MESHSCOPE_OPERATOR_METRICS_URL``): Prometheus, VictoriaMetrics (``vmselect``'s ``/select/0/prometheus``),
    Thanos Query, Mimir (``/prometheus``). Empty (the default): no continuous tier."""
    metrics_interval_seconds: float = 30.0
    """Seconds between two reads of the store per TrainingJob (``MESHSCOPE_OPERATOR_METRICS_INTERVAL_SECONDS``,
    1 to 86400; default 30, the usual scrape interval: a faster read sees the same samples)."""
    metrics_timeout_seconds: float = 10.0
    """Seconds one query may take, connection included (``MESHSCOPE_OPERATOR_METRICS_TIMEOUT_SECONDS``, 0.1 to
    300; default 10). Also sent to the store as its ``timeout`` parameter, so it gives up too."""
    deep_interval_seconds: float = 300.0
    """Seconds between two deep analyses of a TrainingJob (``MESHSCOPE_OPERATOR_DEEP_INTERVAL_SECONDS``, 10 to
    86400; default 300). The annotation ``analyze.meshscope.io/now`` runs one at once."""
    deep_window_steps: int = 2
    """Steps of records pulled from every sidecar per deep analysis (``MESHSCOPE_OPERATOR_DEEP_WINDOW_STEPS``, 1 to
    64, the most a sidecar keeps; default 2: at 16,384 ranks of Llama 3 405B that is 38 M intervals, about 4 GiB of
    working set, docs/scale.md)."""
    deep_window_rank_steps: int = 16_384
    """Most rank-steps per window (``MESHSCOPE_OPERATOR_DEEP_WINDOW_RANK_STEPS``, 1 to 16,777,216; default 16,384):
    a job of more ranks than this over ``deep_window_steps`` steps gets fewer steps per window, at least one. Bounds
    the analysis' time: at 16,384 ranks of Llama 3 405B one step takes ~12 s, two ~30 s (docs/scale.md)."""
    deep_timeout_seconds: float = 30.0
    """Seconds one sidecar's ``/v1/steps`` answer may take (``MESHSCOPE_OPERATOR_DEEP_TIMEOUT_SECONDS``, 0.1 to
    600; default 30); a sidecar that takes longer is noted as missing, not waited for."""
    deep_concurrency: int = 64
    """Sidecars asked at the same time (``MESHSCOPE_OPERATOR_DEEP_CONCURRENCY``, 1 to 4096; default 64)."""
    deep_pod_max_bytes: int = 64 * MiB
    """Most bytes read from one sidecar per analysis (``MESHSCOPE_OPERATOR_DEEP_POD_MAX_BYTES``, 1 KiB to 1 GiB;
    default 64 MiB, twice what a sidecar keeps); beyond it the answer is cut at a whole record and noted."""
    deep_total_max_bytes: int = 8192 * MiB
    """Most bytes read from all sidecars together per analysis (``MESHSCOPE_OPERATOR_DEEP_TOTAL_MAX_BYTES``, 1 KiB
    to 64 GiB; default 8 GiB): bounds the deep tier's working set; pods past it are noted as missing."""


_ENV = {f.name: PREFIX + f.name.upper() for f in fields(OperatorSettings)}
"""Each field's environment variable."""


def env_name(field_name: str) -> str:
    """The environment variable of a field of :class:`OperatorSettings`: ``MESHSCOPE_OPERATOR_WEBHOOK_PORT``."""
    return _ENV[field_name]


def _int(name: str, value: str, *, minimum: int, maximum: int) -> int:
    try:
        number = int(value.strip())
    except ValueError:
        number = minimum - 1
    if not minimum <= number <= maximum:
        raise SettingsError(f"{name}={value!r} is not a whole number from {minimum} to {maximum}")
    return number


def _seconds(name: str, value: str, *, minimum: float, maximum: float) -> float:
    try:
        number = float(value.strip())
    except ValueError:
        number = math.nan
    if not minimum <= number <= maximum:  # NaN and inf fail too
        raise SettingsError(f"{name}={value!r} is not a number of seconds from {minimum:g} to {maximum:g}")
    return number


def _optional_seconds(
    raw: Mapping[str, str], field_name: str, default: float, *, minimum: float, maximum: float
) -> float:
    if field_name not in raw:
        return default
    return _seconds(_ENV[field_name], raw[field_name], minimum=minimum, maximum=maximum)


def _optional_int(raw: Mapping[str, str], field_name: str, default: int, *, minimum: int, maximum: int) -> int:
    if field_name not in raw:
        return default
    return _int(_ENV[field_name], raw[field_name], minimum=minimum, maximum=maximum)


def _store_url(value: str) -> str:
    url = value.rstrip("/")
    if url:
        _match(_ENV["metrics_url"], url, _STORE_URL, "an http:// or https:// URL without a query")
    return url


def _match(name: str, value: str, pattern: re.Pattern[str], what: str) -> str:
    if not pattern.match(value):
        raise SettingsError(f"{name}={value!r} is not {what}")
    return value


def settings_from(environ: Mapping[str, str]) -> OperatorSettings:
    """The settings from the environment (variables left unset or empty take the defaults).

    Args:
        environ: the process environment (``os.environ`` in ``__main__``).

    Returns:
        The checked settings.

    Raises:
        SettingsError: naming the variable, its value and what would fit.
    """
    d = OperatorSettings()
    raw = {f: environ[v].strip() for f, v in _ENV.items() if environ.get(v, "").strip()}

    def text(field_name: str, default: str) -> str:
        return raw.get(field_name, default)

    namespaces = d.namespaces
    if "namespaces" in raw:
        namespaces = tuple(n.strip() for n in raw["namespaces"].split(",") if n.strip())
        for n in namespaces:
            _match(_ENV["namespaces"], n, _NAMESPACE, "a comma-separated list of namespace names")
    level = text("log_level", d.log_level).lower()
    if level not in {"debug", "info", "warning", "error"}:
        raise SettingsError(f"{_ENV['log_level']}={level!r} is not one of debug, info, warning, error")
    policy = text("sidecar_image_pull_policy", d.sidecar_image_pull_policy)
    if policy not in _PULL_POLICIES:
        raise SettingsError(f"{_ENV['sidecar_image_pull_policy']}={policy!r} is not one of {', '.join(_PULL_POLICIES)}")

    def port(field_name: str, default: int, minimum: int) -> int:
        if field_name not in raw:
            return default
        return _int(_ENV[field_name], raw[field_name], minimum=minimum, maximum=65535)

    def quantity(field_name: str, default: str) -> str:
        value = text(field_name, default)
        return _match(_ENV[field_name], value, _QUANTITY, "a Kubernetes quantity such as 100m, 256Mi or 1Gi")

    return OperatorSettings(
        namespaces=namespaces,
        peering=text("peering", d.peering),
        liveness_port=port("liveness_port", d.liveness_port, 0),
        log_level=level,
        webhook_addr=text("webhook_addr", d.webhook_addr),
        webhook_port=port("webhook_port", d.webhook_port, 0),
        webhook_host=text("webhook_host", d.webhook_host),
        webhook_cert_file=text("webhook_cert_file", d.webhook_cert_file),
        webhook_key_file=text("webhook_key_file", d.webhook_key_file),
        webhook_ca_file=text("webhook_ca_file", d.webhook_ca_file),
        webhook_managed=text("webhook_managed", d.webhook_managed),
        max_warnings=(
            _int(_ENV["max_warnings"], raw["max_warnings"], minimum=1, maximum=MAX_ADMISSION_WARNINGS)
            if "max_warnings" in raw
            else d.max_warnings
        ),
        max_planned_gpus=(
            _int(_ENV["max_planned_gpus"], raw["max_planned_gpus"], minimum=1, maximum=1 << 30)
            if "max_planned_gpus" in raw
            else d.max_planned_gpus
        ),
        sidecar_image=_match(
            _ENV["sidecar_image"], text("sidecar_image", d.sidecar_image), _IMAGE, "an image reference"
        ),
        sidecar_image_pull_policy=policy,
        sidecar_port=port("sidecar_port", d.sidecar_port, 1),
        sidecar_cpu_request=quantity("sidecar_cpu_request", d.sidecar_cpu_request),
        sidecar_memory_request=quantity("sidecar_memory_request", d.sidecar_memory_request),
        sidecar_memory_limit=quantity("sidecar_memory_limit", d.sidecar_memory_limit),
        # An empty value means "no DCGM source", so this one is read even when set to "".
        dcgm_url=environ[_ENV["dcgm_url"]].strip() if _ENV["dcgm_url"] in environ else d.dcgm_url,
        nccl_debug_subsys=text("nccl_debug_subsys", d.nccl_debug_subsys),
        api_server=(
            _match(
                _ENV["api_server"], raw["api_server"], _URL, "an http:// or https:// URL such as https://10.0.0.1:443"
            )
            if "api_server" in raw
            else d.api_server
        ),
        master_port=port("master_port", d.master_port, 1),
        nvlink_domain_label=_label_key(_ENV["nvlink_domain_label"], text("nvlink_domain_label", d.nvlink_domain_label)),
        network_tier_labels=_tier_labels(raw.get("network_tier_labels"), d.network_tier_labels),
        metrics_url=_store_url(text("metrics_url", d.metrics_url)),
        metrics_interval_seconds=_optional_seconds(
            raw, "metrics_interval_seconds", d.metrics_interval_seconds, minimum=1.0, maximum=86400.0
        ),
        metrics_timeout_seconds=_optional_seconds(
            raw, "metrics_timeout_seconds", d.metrics_timeout_seconds, minimum=0.1, maximum=300.0
        ),
        deep_interval_seconds=_optional_seconds(
            raw, "deep_interval_seconds", d.deep_interval_seconds, minimum=10.0, maximum=86400.0
        ),
        deep_window_steps=_optional_int(raw, "deep_window_steps", d.deep_window_steps, minimum=1, maximum=64),
        deep_window_rank_steps=_optional_int(
            raw, "deep_window_rank_steps", d.deep_window_rank_steps, minimum=1, maximum=1 << 24
        ),
        deep_timeout_seconds=_optional_seconds(
            raw, "deep_timeout_seconds", d.deep_timeout_seconds, minimum=0.1, maximum=600.0
        ),
        deep_concurrency=_optional_int(raw, "deep_concurrency", d.deep_concurrency, minimum=1, maximum=4096),
        deep_pod_max_bytes=_optional_int(
            raw, "deep_pod_max_bytes", d.deep_pod_max_bytes, minimum=1024, maximum=1024 * MiB
        ),
        deep_total_max_bytes=_optional_int(
            raw, "deep_total_max_bytes", d.deep_total_max_bytes, minimum=1024, maximum=64 * 1024 * MiB
        ),
    )


def _label_key(name: str, value: str) -> str:
    if len(value) > 317 or not _LABEL_KEY.match(value):
        raise SettingsError(f"{name}={value!r} is not a node label key such as nvidia.com/gpu.clique")
    return value


def _tier_labels(value: str | None, default: tuple[str, ...]) -> tuple[str, ...]:
    if value is None:
        return default
    name = _ENV["network_tier_labels"]
    keys = tuple(k.strip() for k in value.split(",") if k.strip())
    if not 1 <= len(keys) <= MAX_NETWORK_TIERS:
        raise SettingsError(f"{name}={value!r} is not 1 to {MAX_NETWORK_TIERS} comma-separated node label keys")
    for k in keys:
        _label_key(name, k)
    return keys

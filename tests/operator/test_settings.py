"""The operator's settings from the environment: defaults, every variable, and bad values named with what fits."""

from __future__ import annotations

import dataclasses

import pytest

from meshscope_operator.settings import OperatorSettings, SettingsError, env_name, settings_from


def test_no_variables_give_the_defaults() -> None:
    s = settings_from({})
    assert s == OperatorSettings()
    assert (s.webhook_port, s.sidecar_port, s.max_warnings, s.max_planned_gpus) == (9443, 9402, 10, 262_144)
    assert s.namespaces == ()
    assert s.webhook_managed == ""


def test_every_field_has_a_variable_of_its_own_name() -> None:
    names = [env_name(f.name) for f in dataclasses.fields(OperatorSettings)]
    assert len(set(names)) == len(names)
    assert "MESHSCOPE_OPERATOR_WEBHOOK_CERT_FILE" in names
    assert all(n.startswith("MESHSCOPE_OPERATOR_") for n in names)


def test_variables_are_read() -> None:
    s = settings_from(
        {
            "MESHSCOPE_OPERATOR_NAMESPACES": "training, research ,",
            "MESHSCOPE_OPERATOR_WEBHOOK_PORT": "8443",
            "MESHSCOPE_OPERATOR_WEBHOOK_MANAGED": "meshscope.io",
            "MESHSCOPE_OPERATOR_MAX_WARNINGS": "15",
            "MESHSCOPE_OPERATOR_SIDECAR_IMAGE": "ghcr.io/acme/meshscope-sidecar@sha256:0123",
            "MESHSCOPE_OPERATOR_SIDECAR_MEMORY_LIMIT": "1Gi",
            "MESHSCOPE_OPERATOR_LOG_LEVEL": "DEBUG",
            "MESHSCOPE_OPERATOR_DCGM_URL": "",
            "MESHSCOPE_OPERATOR_PEERING": "",  # empty is unset
        }
    )
    assert s.namespaces == ("training", "research")
    assert s.webhook_port == 8443
    assert s.webhook_managed == "meshscope.io"
    assert s.max_warnings == 15
    assert s.sidecar_image == "ghcr.io/acme/meshscope-sidecar@sha256:0123"
    assert s.sidecar_memory_limit == "1Gi"
    assert s.log_level == "debug"
    assert s.dcgm_url == ""  # set to empty: no DCGM source
    assert s.peering == ""


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("MESHSCOPE_OPERATOR_WEBHOOK_PORT", "70000", "MESHSCOPE_OPERATOR_WEBHOOK_PORT='70000' is not a whole number"),
        ("MESHSCOPE_OPERATOR_WEBHOOK_PORT", "https", "from 0 to 65535"),
        ("MESHSCOPE_OPERATOR_SIDECAR_PORT", "0", "from 1 to 65535"),
        (
            "MESHSCOPE_OPERATOR_MAX_WARNINGS",
            "16",
            "MESHSCOPE_OPERATOR_MAX_WARNINGS='16' is not a whole number from 1 to 15",
        ),
        ("MESHSCOPE_OPERATOR_MAX_PLANNED_GPUS", "0", "from 1 to 1073741824"),
        ("MESHSCOPE_OPERATOR_NAMESPACES", "Training", "is not a comma-separated list of namespace names"),
        ("MESHSCOPE_OPERATOR_LOG_LEVEL", "loud", "is not one of debug, info, warning, error"),
        ("MESHSCOPE_OPERATOR_SIDECAR_IMAGE_PULL_POLICY", "sometimes", "is not one of Always, IfNotPresent, Never"),
        ("MESHSCOPE_OPERATOR_SIDECAR_MEMORY_LIMIT", "lots", "is not a Kubernetes quantity"),
        ("MESHSCOPE_OPERATOR_SIDECAR_IMAGE", "my image", "is not an image reference"),
    ],
    ids=lambda v: v if v.startswith("MESHSCOPE") else "",
)
def test_a_bad_value_names_the_variable_and_what_fits(variable: str, value: str, message: str) -> None:
    with pytest.raises(SettingsError, match="^" + variable) as err:
        settings_from({variable: value})
    assert message in str(err.value)


def test_the_cost_tiers_settings_are_read() -> None:
    s = settings_from(
        {
            "MESHSCOPE_OPERATOR_METRICS_URL": "http://vmselect.monitoring:8481/select/0/prometheus/",
            "MESHSCOPE_OPERATOR_METRICS_INTERVAL_SECONDS": "15",
            "MESHSCOPE_OPERATOR_METRICS_TIMEOUT_SECONDS": "2.5",
            "MESHSCOPE_OPERATOR_DEEP_INTERVAL_SECONDS": "600",
            "MESHSCOPE_OPERATOR_DEEP_WINDOW_STEPS": "4",
            "MESHSCOPE_OPERATOR_DEEP_WINDOW_RANK_STEPS": "4096",
            "MESHSCOPE_OPERATOR_DEEP_TIMEOUT_SECONDS": "12",
            "MESHSCOPE_OPERATOR_DEEP_CONCURRENCY": "128",
            "MESHSCOPE_OPERATOR_DEEP_POD_MAX_BYTES": "1048576",
            "MESHSCOPE_OPERATOR_DEEP_TOTAL_MAX_BYTES": "1073741824",
        }
    )
    assert s.metrics_url == "http://vmselect.monitoring:8481/select/0/prometheus"  # the trailing slash dropped
    assert (s.metrics_interval_seconds, s.metrics_timeout_seconds) == (15.0, 2.5)
    assert (s.deep_interval_seconds, s.deep_window_steps, s.deep_timeout_seconds) == (600.0, 4, 12.0)
    assert s.deep_window_rank_steps == 4096
    assert (s.deep_concurrency, s.deep_pod_max_bytes, s.deep_total_max_bytes) == (128, 1 << 20, 1 << 30)
    d = settings_from({})
    assert d.metrics_url == ""  # no store: no continuous tier
    assert (d.deep_interval_seconds, d.deep_window_steps, d.deep_pod_max_bytes) == (300.0, 2, 64 << 20)
    assert d.deep_window_rank_steps == 16384


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("MESHSCOPE_OPERATOR_METRICS_URL", "prometheus:9090", "is not an http:// or https:// URL without a query"),
        ("MESHSCOPE_OPERATOR_METRICS_URL", "http://p:9090/api?x=1", "without a query"),
        ("MESHSCOPE_OPERATOR_METRICS_INTERVAL_SECONDS", "0.5", "is not a number of seconds from 1 to 86400"),
        ("MESHSCOPE_OPERATOR_METRICS_TIMEOUT_SECONDS", "nan", "is not a number of seconds from 0.1 to 300"),
        ("MESHSCOPE_OPERATOR_DEEP_INTERVAL_SECONDS", "inf", "from 10 to 86400"),
        ("MESHSCOPE_OPERATOR_DEEP_INTERVAL_SECONDS", "5m", "is not a number of seconds"),
        ("MESHSCOPE_OPERATOR_DEEP_WINDOW_STEPS", "65", "is not a whole number from 1 to 64"),
        ("MESHSCOPE_OPERATOR_DEEP_WINDOW_RANK_STEPS", "0", "is not a whole number from 1 to 16777216"),
        ("MESHSCOPE_OPERATOR_DEEP_TIMEOUT_SECONDS", "-1", "from 0.1 to 600"),
        ("MESHSCOPE_OPERATOR_DEEP_CONCURRENCY", "0", "from 1 to 4096"),
        ("MESHSCOPE_OPERATOR_DEEP_POD_MAX_BYTES", "64Mi", "is not a whole number from 1024 to 1073741824"),
        ("MESHSCOPE_OPERATOR_DEEP_TOTAL_MAX_BYTES", "100", "from 1024 to 68719476736"),
    ],
    ids=lambda v: v if v.startswith("MESHSCOPE") else "",
)
def test_a_bad_cost_tier_setting_names_the_variable(variable: str, value: str, message: str) -> None:
    with pytest.raises(SettingsError, match="^" + variable) as err:
        settings_from({variable: value})
    assert message in str(err.value)

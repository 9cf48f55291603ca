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

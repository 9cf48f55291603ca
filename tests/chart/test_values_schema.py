"""values.schema.json, through Helm's own validator: bad values refused with the key, the value and the rule.

Where the operator checks the same value (its settings), the schema must agree with it: a value the chart takes
must start the operator, and a value the operator would refuse at start-up must be refused at ``helm install``
instead of ending in a crash loop. Hypothesis draws the values; ``settings_from`` is the oracle.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from charting import CHART, CONFIGURATIONS, ci_values, container, documented_values, render, schema_error
from meshscope_operator.settings import SettingsError, env_name, settings_from

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SCHEMA = json.loads((CHART / "values.schema.json").read_text())


def at(path: str, value: Any) -> dict[str, Any]:
    """``{"a": {"b": value}}`` for ``"a.b"``."""
    out: dict[str, Any] = value
    for key in reversed(path.split(".")):
        out = {key: out}
    return out


def _dotted(values: dict[str, Any]) -> str:
    """``"a.b"`` for ``{"a": {"b": ...}}``: the key a bad value sits at."""
    key, value = next(iter(values.items()))
    return f"{key}.{_dotted(value)}" if isinstance(value, dict) and len(value) == 1 and key != "labels" else key


def operator_accepts(field: str, value: str) -> bool:
    try:
        settings_from({env_name(field): value})
    except SettingsError:
        return False
    return True


@pytest.mark.parametrize("configuration", CONFIGURATIONS)
def test_every_supported_configuration_fits_the_schema(configuration: str) -> None:
    assert schema_error(ci_values(configuration)) is None


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (at("operator.replicas", "two"), "at '/operator/replicas': got string, want integer"),
        # none: the TrainingJob webhook, failing closed, would refuse every TrainingJob
        (at("operator.replicas", 0), "at '/operator/replicas': minimum: got 0, want 1"),
        (at("operator.maxWarnings", 16), "at '/operator/maxWarnings': maximum: got 16, want 15"),
        (at("operator.logLevel", "verbose"), "at '/operator/logLevel': value must be one of 'debug', 'info'"),
        (at("webhook.timeoutSeconds", 31), "at '/webhook/timeoutSeconds': maximum: got 31, want 30"),
        (at("webhook.certificates.mode", "acme"), "at '/webhook/certificates/mode': value must be one of 'selfSigned'"),
        (at("sidecar.cpuRequest", "1 cpu"), "at '/sidecar/cpuRequest': '1 cpu' does not match pattern"),
        (at("operator.namespaces", ["Prod"]), "at '/operator/namespaces/0': 'Prod' does not match pattern"),
        (
            at("monitoring.dashboard.labels", {"grafana_dashboard": 1}),
            "at '/monitoring/dashboard/labels/grafana_dashboard'",
        ),
        (at("monitoring.podMonitor.interval", "30 seconds"), "at '/monitoring/podMonitor/interval'"),
        (at("operator.resourcs", {}), "additional properties 'resourcs' not allowed"),
        (at("crds.enabled", "yes"), "at '/crds/enabled': got string, want boolean"),
        (
            at("operator.securityContext", {"readOnlyRootFilesytem": True}),
            "at '/operator/securityContext': additional properties 'readOnlyRootFilesytem' not allowed",
        ),
        (at("operator.podSecurityContext.runAsUser", -1), "at '/operator/podSecurityContext/runAsUser': minimum"),
    ],
    ids=lambda v: _dotted(v) if isinstance(v, dict) else "message",
)
def test_bad_values_are_refused_naming_the_key_the_value_and_the_rule(values: dict[str, Any], message: str) -> None:
    error = schema_error(values)
    assert error is not None
    assert message in error


def test_a_quantity_given_as_a_number_is_taken_and_rendered_as_one() -> None:
    # `--set sidecar.cpuRequest=1` gives the number 1, which the schema refused ("got number, want string")
    for value, text in ((1, "1"), (0.5, "0.5")):
        assert schema_error(at("sidecar.cpuRequest", value)) is None
        env = {e["name"]: e.get("value") for e in container(render(at("sidecar.cpuRequest", value)))["env"]}
        assert env["MESHSCOPE_OPERATOR_SIDECAR_CPU_REQUEST"] == text
        assert operator_accepts("sidecar_cpu_request", text)
    assert schema_error(at("sidecar.cpuRequest", 0)) is not None


_QUANTITY_TEXT = st.text(alphabet="0123456789.mkKMGTi", min_size=1, max_size=8)


@SETTINGS
@given(value=st.one_of(_QUANTITY_TEXT, st.sampled_from(["100m", "256Mi", "1Gi", "1.5", "0.5Gi", ".5", "1e3", "Mi"])))
def test_the_schema_and_the_operator_agree_on_quantities(value: str) -> None:
    for key, field in (
        ("cpuRequest", "sidecar_cpu_request"),
        ("memoryRequest", "sidecar_memory_request"),
        ("memoryLimit", "sidecar_memory_limit"),
    ):
        assert (schema_error(at(f"sidecar.{key}", value)) is None) == operator_accepts(field, value), (key, value)


@SETTINGS
@given(number=st.integers(min_value=-5, max_value=(1 << 30) + 5) | st.integers(min_value=-5, max_value=70_000))
def test_the_schema_and_the_operator_agree_on_whole_numbers(number: int) -> None:
    for key, field in (
        ("operator.maxWarnings", "max_warnings"),
        ("operator.maxPlannedGpus", "max_planned_gpus"),
        ("sidecar.port", "sidecar_port"),
    ):
        assert (schema_error(at(key, number)) is None) == operator_accepts(field, str(number)), (key, number)


@SETTINGS
@given(
    level=st.text(alphabet="abcdefghijklmnopqrstuvwxyz", min_size=1, max_size=8) | st.sampled_from(["info", "debug"])
)
def test_a_log_level_the_chart_takes_starts_the_operator(level: str) -> None:
    # The operator also takes upper case; the chart asks for the lower-case spelling it documents.
    if schema_error(at("operator.logLevel", level)) is None:
        assert operator_accepts("log_level", level)
    else:
        assert not operator_accepts("log_level", level)


@SETTINGS
@given(names=st.lists(st.from_regex(r"\A[a-z0-9-]{1,12}\Z", fullmatch=True), min_size=1, max_size=3, unique=True))
def test_watched_namespaces_the_chart_takes_start_the_operator(names: list[str]) -> None:
    if schema_error(at("operator.namespaces", names)) is None:
        assert operator_accepts("namespaces", ",".join(names))
    else:
        assert not operator_accepts("namespaces", ",".join(names))


@pytest.mark.parametrize(
    ("definition", "kubernetes"),
    [
        ("securityContext", "securitycontext-v1.json"),
        ("podSecurityContext", "podsecuritycontext-v1.json"),
        ("toleration", "toleration-v1.json"),
        ("affinity", "affinity-v1.json"),
    ],
)
def test_the_closed_kubernetes_objects_have_the_fields_of_kubernetes_1_32(definition: str, kubernetes: str) -> None:
    # A typo in a security context is refused at `helm install`, and no real field is: the names are Kubernetes
    # 1.32's, as kubernetes-validate bundles its schemas.
    bundled = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema" / "v1.32.0-local-strict"
    theirs = json.loads((bundled / kubernetes).read_text())
    ours = SCHEMA["$defs"][definition]
    assert ours["additionalProperties"] is False
    assert set(ours["properties"]) == set(theirs["properties"])


_LABEL_TEXT = st.text(alphabet="abcXYZ019-._/", min_size=1, max_size=20)


@SETTINGS
@given(key=_LABEL_TEXT | st.sampled_from(["nvidia.com/gpu.clique", "a/b/c", "-a", "a_b", "x" * 64, "p.q/" + "y" * 63]))
def test_the_schema_and_the_operator_agree_on_node_label_keys(key: str) -> None:
    assert (schema_error(at("topology.nvlinkDomainLabel", key)) is None) == operator_accepts(
        "nvlink_domain_label", key
    ), key
    assert (schema_error(at("topology.networkTierLabels", [key])) is None) == operator_accepts(
        "network_tier_labels", key
    ), key


@SETTINGS
@given(
    url=st.sampled_from(["https://10.0.0.1:443", "http://api", "https://h/p?q", "ftp://h", "https://", "https:// h"])
    | st.text(alphabet="htps:/.a1 ", min_size=1, max_size=16)
)
def test_the_schema_and_the_operator_agree_on_the_api_server_url(url: str) -> None:
    assume(url.strip() == url)  # the operator strips the value; the chart passes it as written
    assert (schema_error(at("operator.apiServer", url)) is None) == operator_accepts("api_server", url), url


def test_every_schema_property_is_a_documented_value_and_back() -> None:
    def paths(node: dict[str, Any], path: str = "") -> dict[str, bool]:
        """Every declared key of the schema, mapped to whether it is a leaf (no declared keys below it)."""
        if "$ref" in node:
            node = SCHEMA["$defs"][node["$ref"].rsplit("/", 1)[1]]
        out: dict[str, bool] = {}
        for key, child in node.get("properties", {}).items():
            below = paths(child, f"{path}.{key}" if path else key)
            out[f"{path}.{key}" if path else key] = not below
            out.update(below)
        return out

    declared = paths(SCHEMA)
    declared.pop("global")
    documented = {v.path for v in documented_values()}

    def covered(path: str) -> bool:
        parts = path.split(".")
        return any(".".join(parts[:i]) in documented for i in range(1, len(parts) + 1))

    assert {p for p, leaf in declared.items() if leaf and not covered(p)} == set()  # every value documented
    assert documented - set(declared) == set()  # no documented value the schema does not know

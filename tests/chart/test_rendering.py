"""The chart rendered by real Helm in every supported configuration, linted, and every object validated.

Builtin kinds are checked by kubernetes-validate against Kubernetes 1.32's schemas, strictly (an unknown field is an
error, as ``kubectl apply --validate=strict`` makes it); the custom resources (PrometheusRule, PodMonitor, Certificate,
Issuer) against the structural schemas below, written from the Prometheus Operator's and cert-manager's API
references for the fields the chart uses, with unknown fields rejected.
"""

from __future__ import annotations

import json
import subprocess
import tarfile
import tomllib
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml

from charting import CHART, CONFIGURATIONS, KUBE_VERSION, NAMESPACE, ROOT, ci_values, render, render_configuration
from meshscope_operator.injection import LABEL, InjectionTarget, sidecar_container
from meshscope_operator.settings import OperatorSettings

CUSTOM_KINDS = {"PrometheusRule", "PodMonitor", "Certificate", "Issuer"}

_STR = {"type": "string", "minLength": 1}
_LABELS = {"type": "object", "additionalProperties": {"type": "string"}}
_META = {
    "type": "object",
    "required": ["name", "namespace"],
    "properties": {"name": _STR, "namespace": _STR, "labels": _LABELS, "annotations": _LABELS},
    "additionalProperties": False,
}
_DURATION = {"type": "string", "pattern": "^([0-9]+(ms|s|m|h|d|w|y))+$"}


def _cr(api_version: str, kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "additionalProperties": False,
        "properties": {"apiVersion": {"const": api_version}, "kind": {"const": kind}, "metadata": _META, "spec": spec},
    }


def _closed(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


CR_SCHEMAS: dict[str, dict[str, Any]] = {
    # monitoring.coreos.com/v1 PrometheusRule: spec.groups[].rules[] with record or alert, expr.
    "PrometheusRule": _cr(
        "monitoring.coreos.com/v1",
        "PrometheusRule",
        _closed(
            {
                "groups": {
                    "type": "array",
                    "minItems": 1,
                    "items": _closed(
                        {
                            "name": _STR,
                            "interval": _DURATION,
                            "rules": {
                                "type": "array",
                                "minItems": 1,
                                "items": _closed(
                                    {"record": _STR, "alert": _STR, "expr": _STR, "labels": _LABELS, "for": _DURATION},
                                    ["expr"],
                                ),
                            },
                        },
                        ["name", "rules"],
                    ),
                }
            },
            ["groups"],
        ),
    ),
    # monitoring.coreos.com/v1 PodMonitor: a label selector, namespaces, endpoints by port name.
    "PodMonitor": _cr(
        "monitoring.coreos.com/v1",
        "PodMonitor",
        _closed(
            {
                "selector": {"type": "object", "minProperties": 1},
                "namespaceSelector": {
                    "oneOf": [
                        _closed({"any": {"const": True}}, ["any"]),
                        _closed({"matchNames": {"type": "array", "items": _STR, "minItems": 1}}, ["matchNames"]),
                    ]
                },
                "podMetricsEndpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": _closed(
                        {
                            "port": _STR,
                            "path": _STR,
                            "scheme": {"enum": ["http", "https"]},
                            "honorLabels": {"type": "boolean"},
                            "interval": _DURATION,
                            "scrapeTimeout": _DURATION,
                        },
                        ["port"],
                    ),
                },
            },
            ["selector", "namespaceSelector", "podMetricsEndpoints"],
        ),
    ),
    # cert-manager.io/v1 Certificate and Issuer.
    "Certificate": _cr(
        "cert-manager.io/v1",
        "Certificate",
        _closed(
            {
                "secretName": _STR,
                "duration": {"type": "string", "pattern": "^([0-9]+(\\.[0-9]+)?(h|m|s))+$"},
                "commonName": {"type": "string", "minLength": 1, "maxLength": 64},
                "dnsNames": {"type": "array", "items": _STR, "minItems": 1},
                "privateKey": _closed(
                    {
                        "algorithm": {"enum": ["RSA", "ECDSA", "Ed25519"]},
                        "size": {"type": "integer"},
                        "rotationPolicy": {"enum": ["Never", "Always"]},
                    },
                    [],
                ),
                "issuerRef": _closed(
                    {"name": _STR, "kind": {"enum": ["Issuer", "ClusterIssuer"]}, "group": _STR}, ["name"]
                ),
            },
            ["secretName", "issuerRef", "dnsNames"],
        ),
    ),
    "Issuer": _cr("cert-manager.io/v1", "Issuer", _closed({"selfSigned": _closed({}, [])}, ["selfSigned"])),
}


def test_app_version_is_the_distributions_version() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert chart["apiVersion"] == "v2"
    assert chart["appVersion"] == version


@pytest.mark.parametrize("configuration", CONFIGURATIONS)
def test_helm_lint_strict_finds_nothing(configuration: str) -> None:
    report = helm.lint(str(CHART), ci_values(configuration), strict=True, kube_version=f"v{KUBE_VERSION}")
    # severity 1 is "info" (Helm only recommends an icon); warnings (2) and errors (3) fail under --strict
    findings = [m for m in report["messages"] if m["severity"] >= 2]
    assert findings == [], findings
    assert report["errors"] == []


@pytest.mark.parametrize("configuration", CONFIGURATIONS)
def test_every_rendered_object_is_valid(configuration: str) -> None:
    rendered = render_configuration(configuration)
    assert rendered.objects
    for obj in rendered.objects:
        where = f"{obj['kind']} {obj['metadata']['name']}"
        if obj["kind"] in CUSTOM_KINDS:
            errors = [
                f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in _validator(obj["kind"]).iter_errors(obj)
            ]
            assert errors == [], (where, errors)
        else:
            try:
                kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{where}: {exc}")


def _validator(kind: str) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(CR_SCHEMAS[kind])


def test_the_validators_catch_a_broken_object() -> None:
    # Guards the test above: both validators fail on what the API server would refuse.
    deployment = render().one("Deployment")
    broken = yaml.safe_load(yaml.safe_dump(deployment))
    broken["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError, match="replicas"):
        kubernetes_validate.validate(broken, KUBE_VERSION, strict=True)
    unknown = yaml.safe_load(yaml.safe_dump(deployment))
    unknown["spec"]["template"]["spec"]["containers"][0]["securityContxt"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(unknown, KUBE_VERSION, strict=True)
    monitor = yaml.safe_load(yaml.safe_dump(render(MONITORING).one("PodMonitor")))
    monitor["spec"]["podMetricsEndpoints"][0]["honourLabels"] = True
    assert list(_validator("PodMonitor").iter_errors(monitor))


@pytest.mark.parametrize("configuration", CONFIGURATIONS)
def test_objects_live_in_the_release_namespace_or_are_cluster_scoped(configuration: str) -> None:
    values = ci_values(configuration)
    cluster_scoped = {
        "CustomResourceDefinition",
        "ClusterRole",
        "ClusterRoleBinding",
        "ValidatingWebhookConfiguration",
        "MutatingWebhookConfiguration",
    }
    watched = set(values.get("operator", {}).get("namespaces", []))
    dashboard_ns = values.get("monitoring", {}).get("dashboard", {}).get("namespace") or NAMESPACE
    for obj in render_configuration(configuration).objects:
        namespace = obj["metadata"].get("namespace")
        if obj["kind"] in cluster_scoped:
            assert namespace is None, obj["metadata"]
        elif obj["kind"] in {"Role", "RoleBinding"}:
            assert namespace in watched
        elif obj["kind"] == "ConfigMap":
            assert namespace == dashboard_ns
        else:
            assert namespace == NAMESPACE, (obj["kind"], namespace)


# -- The CRD: the repository's crds/ file, rendered whole, behind crds.enabled -------------------------------------


def test_the_charts_copies_are_byte_identical_to_their_sources() -> None:
    copies = {
        CHART / "files" / "crds" / "trainingjobs.meshscope.io.yaml": ROOT / "crds" / "trainingjobs.meshscope.io.yaml",
        CHART / "files" / "monitoring" / "recording-rules.yaml": ROOT
        / "sidecar"
        / "monitoring"
        / "recording-rules.yaml",
        CHART / "files" / "monitoring" / "dashboard.json": ROOT / "sidecar" / "monitoring" / "dashboard.json",
    }
    for copy, source in copies.items():
        assert copy.read_bytes() == source.read_bytes(), f"{copy} differs from {source}: run `make chart-files`"


def test_the_rendered_crd_is_the_repositorys_crd_plus_the_charts_labels() -> None:
    source = yaml.safe_load((ROOT / "crds" / "trainingjobs.meshscope.io.yaml").read_text())
    rendered = render().one("CustomResourceDefinition")
    labels = rendered["metadata"].pop("labels")
    assert labels["app.kubernetes.io/managed-by"] == "Helm"
    assert labels["app.kubernetes.io/instance"] == "demo"
    assert rendered == source
    # deleting the CRD deletes every TrainingJob: helm uninstall must leave it
    assert rendered["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"


def test_crds_disabled_renders_no_crd() -> None:
    assert render_configuration("no-crds").of_kind("CustomResourceDefinition") == []
    assert "install the TrainingJob CRD yourself" in render_configuration("no-crds").notes


# -- Monitoring: the recording rules, the PodMonitor, the dashboard --------------------------------------------------


def test_the_prometheus_rule_holds_the_recording_rules_unchanged() -> None:
    rules = yaml.safe_load((ROOT / "sidecar" / "monitoring" / "recording-rules.yaml").read_text())
    rule = render(MONITORING).one("PrometheusRule")
    assert rule["spec"]["groups"] == rules["groups"]
    assert sum(len(g["rules"]) for g in rule["spec"]["groups"]) == sum(len(g["rules"]) for g in rules["groups"]) > 0


def test_promtool_accepts_the_rendered_rules(tmp_path: Path) -> None:
    rule = render_configuration("custom").one("PrometheusRule")
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    done = subprocess.run(
        ["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout + done.stderr


def test_the_pod_monitor_scrapes_the_injected_sidecars_port() -> None:
    sidecar = sidecar_container(
        InjectionTarget(job="j", layout="dp=8,tp=1,pp=1,cp=1,ep=1", gpus_per_node=8), OperatorSettings()
    )
    (port,) = sidecar["ports"]  # type: ignore[misc]
    monitor = render(MONITORING).one("PodMonitor")
    assert monitor["spec"]["selector"] == {"matchExpressions": [{"key": LABEL, "operator": "Exists"}]}
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == port["name"]
    assert endpoint["path"] == "/metrics"
    assert endpoint["honorLabels"] is True  # the sidecars' `job` label is the training job's name
    scrape = yaml.safe_load((ROOT / "sidecar" / "monitoring" / "scrape-config.yaml").read_text())[0]
    assert endpoint["interval"] == scrape["scrape_interval"]
    assert endpoint["scrapeTimeout"] == scrape["scrape_timeout"]
    assert monitor["spec"]["namespaceSelector"] == {"any": True}
    custom = render_configuration("custom").one("PodMonitor")
    assert custom["spec"]["namespaceSelector"] == {"matchNames": ["research", "prod"]}
    assert custom["metadata"]["labels"]["release"] == "kube-prometheus-stack"


def test_the_dashboard_config_map_holds_the_dashboard_for_grafanas_sidecar() -> None:
    dashboard = json.loads((ROOT / "sidecar" / "monitoring" / "dashboard.json").read_text())
    config_map = render().one("ConfigMap")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(config_map["data"]["meshscope.json"]) == dashboard
    custom = render_configuration("custom").one("ConfigMap")
    assert custom["metadata"]["labels"]["grafana_dashboard"] == "meshscope"
    assert custom["metadata"]["annotations"] == {"grafana_folder": "Training"}
    assert custom["metadata"]["namespace"] == "monitoring"


MONITORING = {"monitoring": {"prometheusRule": {"enabled": True}, "podMonitor": {"enabled": True}}}
"""The Prometheus Operator's objects, on: they are off by default."""


def test_the_default_install_needs_no_crd_but_its_own() -> None:
    # On a cluster without the Prometheus Operator, `helm install` failed on the PodMonitor and the PrometheusRule
    # ("no matches for kind"): they are opt-in, and NOTES says how to turn them on.
    rendered = render()
    assert not {o["kind"] for o in rendered.objects} & {"PrometheusRule", "PodMonitor"}
    assert {o["apiVersion"].split("/")[0] for o in rendered.objects if "/" in o["apiVersion"]} <= {
        "apps", "policy", "rbac.authorization.k8s.io", "admissionregistration.k8s.io", "apiextensions.k8s.io"
    }  # fmt: skip
    assert "monitoring.podMonitor.enabled=true" in rendered.notes


def test_monitoring_disabled_renders_none_of_it() -> None:
    kinds = {o["kind"] for o in render_configuration("no-monitoring").objects}
    assert not kinds & {"PrometheusRule", "PodMonitor", "ConfigMap"}
    assert "Prometheus Operator" not in render_configuration("no-monitoring").notes


def test_notes_tell_what_to_do_next_with_files_that_exist() -> None:
    notes = render().notes
    applied = [line.split("-f", 1)[1].split()[0] for line in notes.splitlines() if "kubectl apply -f" in line]
    assert applied
    for path in applied:
        assert (ROOT / path).is_file(), path
    assert "kubectl get tj" in notes
    assert "rollout status deployment/demo-meshscope" in notes


def test_the_packaged_chart_renders_the_same_objects(tmp_path: Path) -> None:
    # `helm package` applies .helmignore: what .Files.Get reads must be in the archive, the ci/ values must not.
    archive = Path(helm.package(str(CHART), destination=str(tmp_path)))
    chart_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["version"]
    assert archive.name == f"meshscope-{chart_version}.tgz"
    with tarfile.open(archive) as tar:
        names = set(tar.getnames())
    assert {
        "meshscope/files/crds/trainingjobs.meshscope.io.yaml",
        "meshscope/files/monitoring/recording-rules.yaml",
        "meshscope/files/monitoring/dashboard.json",
        "meshscope/values.schema.json",
        "meshscope/README.md",
    } <= names
    assert not [n for n in names if n.startswith("meshscope/ci/")]
    with helm.Chart.load_archive(archive.read_bytes()) as chart:
        manifests = chart.render({}, name="demo", namespace=NAMESPACE)
    packaged = [
        doc
        for path, text in sorted(manifests.items())
        if not path.endswith("NOTES.txt")
        for doc in yaml.safe_load_all(text)
        if doc
    ]

    def without_certificates(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
        # fresh certificates on every render: everything else must be equal
        out = json.loads(json.dumps(objects))
        for obj in out:
            if obj["kind"] == "Secret":
                obj["data"] = {}
            for webhook in obj.get("webhooks", []):
                webhook["clientConfig"].pop("caBundle", None)
        return out

    assert without_certificates(packaged) == without_certificates(list(render().objects))


def test_the_trainingjob_webhook_is_asked_only_about_a_new_job_or_a_changed_spec() -> None:
    # Fail closed on every UPDATE, a TrainingJob deleted while the operator was down kept kopf's finalizer: removing
    # it (kubectl patch ... finalizers: null, the README's fix) was itself an UPDATE the webhook refused. The match
    # condition, evaluated here with cel-python as the API server would, sends only what the review reads.
    import celpy  # noqa: PLC0415 - a test dependency of the CRD's rules too

    (hook,) = render().one("ValidatingWebhookConfiguration")["webhooks"]
    (condition,) = hook["matchConditions"]
    env = celpy.Environment()
    program = env.program(env.compile(condition["expression"]))
    job = {"metadata": {"name": "j", "finalizers": ["meshscope.io/finalizer"]}, "spec": {"world": {"gpus": 8}}}

    def asked(operation: str, obj: dict[str, Any], old: dict[str, Any] | None) -> bool:
        activation = {"request": {"operation": operation}, "object": obj, "oldObject": old}
        return bool(program.evaluate({k: celpy.json_to_cel(v) for k, v in activation.items()}))

    changed = {**job, "spec": {"world": {"gpus": 16}}}
    annotated = {**job, "metadata": {**job["metadata"], "annotations": {"kopf.zalando.org/last": "x"}}}
    released = {**job, "metadata": {"name": "j", "deletionTimestamp": "2026-12-07T00:00:00Z", "finalizers": []}}
    assert asked("CREATE", job, None)
    assert asked("UPDATE", changed, job)
    assert not asked("UPDATE", annotated, job)  # kopf's progress annotations
    assert not asked("UPDATE", released, {**job, "metadata": {**released["metadata"], "finalizers": ["f"]}})
    assert not asked("UPDATE", {**changed, "metadata": released["metadata"]}, job)  # being deleted: nothing to plan

"""The chart's operator, wired as the operator expects: its settings, its webhooks, its certificates, its RBAC.

Expected values come from the operator itself where it can say them: the env names and defaults from
``meshscope_operator.settings``, the webhook configurations kopf would build for the same handlers
(``kopf._core.engines.admission.build_webhooks``, what kopf writes into configurations it manages), the sidecar's
port name from ``meshscope_operator.injection``; the certificates are checked by a real TLS handshake; RBAC against
the table in charts/meshscope/README.md.
"""

from __future__ import annotations

import base64
import ssl
from dataclasses import fields, replace
from typing import TYPE_CHECKING, Any

import helm_python as helm
import kopf
import pytest
from kopf._core.engines.admission import build_webhooks

from charting import (
    CHART,
    CONFIGURATIONS,
    NAMESPACE,
    ROOT,
    Rendered,
    chart_webhooks,
    ci_values,
    container,
    kubelet_env,
    render,
    render_configuration,
)
from meshscope_operator.admission import MUTATE_ID, VALIDATE_ID
from meshscope_operator.handlers import register
from meshscope_operator.settings import OperatorSettings, env_name, settings_from

if TYPE_CHECKING:
    from pathlib import Path

SETTINGS_ENV = {env_name(f.name) for f in fields(OperatorSettings)}


# -- The Deployment's environment: every setting, and what the operator makes of it ---------------------------------


@pytest.mark.parametrize("configuration", CONFIGURATIONS)
def test_the_env_sets_exactly_the_operators_settings(configuration: str) -> None:
    names = [e["name"] for e in container(render_configuration(configuration))["env"]]
    assert len(names) == len(set(names))
    assert set(names) == SETTINGS_ENV


def test_the_default_env_gives_the_operators_defaults() -> None:
    settings = settings_from(kubelet_env(container(render())["env"]))
    # the differences: the chart mounts the CA beside the certificate, and bounds the deep tier's pull to fit the
    # operator's memory limit (1Gi) instead of the operator's own 8 GiB (values.yaml, costs.deep.totalMaxBytes)
    assert settings == replace(
        OperatorSettings(), webhook_ca_file="/etc/meshscope/webhook/ca.crt", deep_total_max_bytes=256 << 20
    )


def test_custom_values_reach_the_operator() -> None:
    settings = settings_from(kubelet_env(container(render_configuration("custom"))["env"]))
    assert settings.namespaces == ("research", "prod")
    assert settings.peering == "meshscope"
    assert settings.liveness_port == 8081
    assert settings.log_level == "debug"
    assert settings.webhook_port == 10443
    assert settings.max_warnings == 15
    assert settings.max_planned_gpus == 131072
    assert settings.sidecar_image == "registry.example/ml/meshscope-sidecar:0.1.0-rc1"
    assert settings.sidecar_image_pull_policy == "Always"
    assert settings.sidecar_port == 9500
    assert (settings.sidecar_cpu_request, settings.sidecar_memory_request, settings.sidecar_memory_limit) == (
        "200m",
        "300Mi",
        "1Gi",
    )
    assert settings.dcgm_url == "http://dcgm-exporter.gpu-operator.svc:9400/metrics"
    assert settings.nccl_debug_subsys == "INIT,COLL,NET"
    assert settings.webhook_managed == ""  # the chart installs the configurations
    assert settings.api_server == "https://10.0.0.1:443"
    assert settings.master_port == 29400
    assert settings.nvlink_domain_label == "example.com/nvlink-domain"
    assert settings.network_tier_labels == ("example.com/leaf", "example.com/spine", "example.com/core")


def test_an_empty_dcgm_url_reaches_the_operator_as_no_dcgm_source() -> None:
    settings = settings_from(kubelet_env(container(render({"sidecar": {"dcgmUrl": ""}}))["env"]))
    assert settings.dcgm_url == ""


def test_probes_and_ports_point_at_what_the_operator_listens_on() -> None:
    for configuration in ("default", "custom"):
        c = container(render_configuration(configuration))
        env = kubelet_env(c["env"])
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports["healthz"] == int(env["MESHSCOPE_OPERATOR_LIVENESS_PORT"])
        assert ports["webhook"] == int(env["MESHSCOPE_OPERATOR_WEBHOOK_PORT"])
        for probe in (c["livenessProbe"], c["readinessProbe"]):
            assert probe["httpGet"] == {"path": "/healthz", "port": "healthz"}  # kopf's --liveness path


def test_the_operator_runs_locked_down_by_default() -> None:
    deployment = render().one("Deployment")
    pod = deployment["spec"]["template"]["spec"]
    c = container(render())
    dockerfile_user = next(
        line.split()[1]
        for line in (ROOT / "operator" / "Dockerfile").read_text().splitlines()
        if line.startswith("USER")
    )
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert f"{pod['securityContext']['runAsUser']}:{pod['securityContext']['runAsGroup']}" == dockerfile_user
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["runAsNonRoot"] is True
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert c["resources"]["requests"] == {"cpu": "100m", "memory": "256Mi"}
    assert c["resources"]["limits"] == {"memory": "1Gi"}
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}  # standalone: never two operators at once


def test_custom_resources_and_security_contexts_replace_the_defaults() -> None:
    values = ci_values("custom")["operator"]
    rendered = render_configuration("custom")
    pod = rendered.one("Deployment")["spec"]["template"]["spec"]
    c = container(rendered)
    assert c["resources"] == values["resources"]
    assert c["securityContext"] == values["securityContext"]
    assert pod["securityContext"] == values["podSecurityContext"]
    assert pod["tolerations"] == values["tolerations"]
    assert pod["priorityClassName"] == "system-cluster-critical"
    assert pod["serviceAccountName"] == "meshscope-operator"
    assert c["image"] == "registry.example/ml/meshscope-operator:0.1.0-rc1"
    assert rendered.one("Deployment")["spec"]["strategy"] == {"type": "RollingUpdate"}


def test_more_replicas_without_peering_is_refused_with_a_reason() -> None:
    with pytest.raises(
        helm.HelmRenderError, match=r"operator\.replicas=3: more than one replica needs operator\.peering"
    ):
        render({"operator": {"replicas": 3}})


def test_the_webhook_and_liveness_ports_must_differ() -> None:
    with pytest.raises(
        helm.HelmRenderError, match=r"webhook\.port=8080 and operator\.livenessPort=8080: .* cannot share"
    ):
        render({"webhook": {"port": 8080}})


def test_an_existing_service_account_must_be_named() -> None:
    with pytest.raises(helm.HelmRenderError, match=r"serviceAccount\.name: set it"):
        render({"serviceAccount": {"create": False}})
    rendered = render({"serviceAccount": {"create": False, "name": "ops"}})
    assert rendered.of_kind("ServiceAccount") == []
    assert rendered.one("Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == "ops"
    assert rendered.one("ClusterRoleBinding")["subjects"] == [
        {"kind": "ServiceAccount", "name": "ops", "namespace": NAMESPACE}
    ]


# -- Webhooks: the configurations kopf would write for the same handlers, pointed at the Service --------------------


def kopf_webhooks(service: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """What kopf builds for the operator's handlers, in configurations it would manage under the name meshscope.io."""
    registry = kopf.OperatorRegistry()
    register(registry, OperatorSettings())
    resources = [
        kopf.Resource("meshscope.io", "v1alpha1", "trainingjobs", namespaced=True),
        kopf.Resource("", "v1", "pods", namespaced=True),
    ]
    client_config = {"service": {"name": service["name"], "namespace": service["namespace"], "port": service["port"]}}
    built = build_webhooks(
        registry._webhooks.get_all_handlers(),
        resources=resources,
        name_suffix="meshscope.io",
        client_config=client_config,  # type: ignore[arg-type]
    )
    kinds = {h.id: h.reason.value for h in registry._webhooks.get_all_handlers()}
    return {f"{kinds[w['name'].split('.')[0]]}/{w['name']}": w for w in built}


@pytest.mark.parametrize("configuration", CONFIGURATIONS)
def test_the_webhooks_match_what_kopf_serves(configuration: str) -> None:
    rendered = render_configuration(configuration)
    service = rendered.one("Service")
    ours = chart_webhooks(rendered)
    theirs = kopf_webhooks(
        {"name": service["metadata"]["name"], "namespace": NAMESPACE, "port": service["spec"]["ports"][0]["port"]}
    )
    assert set(ours) == set(theirs) == {f"validating/{VALIDATE_ID}.meshscope.io", f"mutating/{MUTATE_ID}.meshscope.io"}
    for key, kopfs in theirs.items():
        chart = ours[key]
        for field in ("sideEffects", "failurePolicy", "matchPolicy", "admissionReviewVersions"):
            assert chart[field] == kopfs[field], (key, field)
        assert chart.get("objectSelector") == kopfs["objectSelector"], key

        def norm(rules: list[dict[str, Any]]) -> list[dict[str, Any]]:
            return [{**r, "operations": sorted(r["operations"])} for r in rules]

        assert norm(chart["rules"]) == norm(kopfs["rules"]), key
        service_config = dict(chart["clientConfig"]["service"].items())
        assert service_config == kopfs["clientConfig"]["service"], key  # name, namespace, port and the handler's path
        assert chart["timeoutSeconds"] == ci_values(configuration).get("webhook", {}).get("timeoutSeconds", 10)


def test_trainingjobs_fail_closed_and_pods_fail_open() -> None:
    webhooks = chart_webhooks(render())
    assert webhooks["validating/trainingjobs.meshscope.io"]["failurePolicy"] == "Fail"
    assert webhooks["mutating/sidecar.meshscope.io"]["failurePolicy"] == "Ignore"


def test_the_service_reaches_the_webhook_port_of_the_operator_pods() -> None:
    for configuration in ("default", "custom"):
        rendered = render_configuration(configuration)
        service = rendered.one("Service")
        template = rendered.one("Deployment")["spec"]["template"]
        labels = template["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= labels.items()
        (port,) = service["spec"]["ports"]
        by_name = {p["name"]: p["containerPort"] for p in container(rendered)["ports"]}
        assert by_name[port["targetPort"]] == int(
            kubelet_env(container(rendered)["env"])["MESHSCOPE_OPERATOR_WEBHOOK_PORT"]
        )


def test_watched_namespaces_limit_both_webhooks() -> None:
    expected = {
        "matchExpressions": [{"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["research", "prod"]}]
    }
    for webhook in chart_webhooks(render_configuration("custom")).values():
        assert webhook["namespaceSelector"] == expected
    for webhook in chart_webhooks(render()).values():
        assert "namespaceSelector" not in webhook


# -- Certificates -----------------------------------------------------------------------------------------------------


def _mounted_secret(rendered: Rendered) -> tuple[str, str]:
    """The Secret the operator mounts and the directory it is mounted at."""
    pod = rendered.one("Deployment")["spec"]["template"]["spec"]
    (mount,) = [m for m in container(rendered)["volumeMounts"] if m["name"] == "webhook-certificates"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "webhook-certificates"]
    return volume["secret"]["secretName"], mount["mountPath"]


def _handshake(server: ssl.SSLContext, client: ssl.SSLContext, hostname: str) -> None:
    """A TLS handshake in memory, the API server (client) calling the webhook (server) by ``hostname``."""
    c_in, c_out, s_in, s_out = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
    c = client.wrap_bio(c_in, c_out, server_hostname=hostname)
    s = server.wrap_bio(s_in, s_out, server_side=True)
    done = {"c": False, "s": False}
    for _ in range(20):  # a TLS 1.3 handshake takes 2 round trips; bounded
        for name, end in (("c", c), ("s", s)):
            if not done[name]:
                try:
                    end.do_handshake()
                    done[name] = True
                except ssl.SSLWantReadError:
                    pass
        s_in.write(c_out.read())
        c_in.write(s_out.read())
        if all(done.values()):
            return
    pytest.fail("the TLS handshake did not finish")


def test_the_self_signed_certificate_is_trusted_by_the_ca_bundle_for_the_service_name(tmp_path: Path) -> None:
    rendered = render()
    secret_name, mount = _mounted_secret(rendered)
    secret = rendered.one("Secret", secret_name)
    assert secret["type"] == "kubernetes.io/tls"
    env = kubelet_env(container(rendered)["env"])
    files = {}
    for key in ("tls.crt", "tls.key", "ca.crt"):
        files[key] = tmp_path / key
        files[key].write_bytes(base64.b64decode(secret["data"][key]))
    # the operator reads exactly these files
    assert env["MESHSCOPE_OPERATOR_WEBHOOK_CERT_FILE"] == f"{mount}/tls.crt"
    assert env["MESHSCOPE_OPERATOR_WEBHOOK_KEY_FILE"] == f"{mount}/tls.key"
    assert env["MESHSCOPE_OPERATOR_WEBHOOK_CA_FILE"] == f"{mount}/ca.crt"
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(files["tls.crt"], files["tls.key"])
    service = rendered.one("Service")["metadata"]["name"]
    for webhook in chart_webhooks(rendered).values():
        bundle = base64.b64decode(webhook["clientConfig"]["caBundle"]).decode()
        assert bundle == files["ca.crt"].read_text()
        client = ssl.create_default_context(cadata=bundle)
        # the name the API server dials for a service reference: <service>.<namespace>.svc
        _handshake(server, client, f"{service}.{NAMESPACE}.svc")
        with pytest.raises(ssl.SSLCertVerificationError):
            _handshake(server, client, f"{service}.elsewhere.svc")


def test_cert_manager_issues_the_secret_the_operator_mounts_and_injects_its_ca() -> None:
    rendered = render_configuration("cert-manager")
    assert rendered.of_kind("Secret") == []
    certificate = rendered.one("Certificate")
    secret_name, _ = _mounted_secret(rendered)
    assert certificate["spec"]["secretName"] == secret_name
    service = rendered.one("Service")["metadata"]["name"]
    assert f"{service}.{NAMESPACE}.svc" in certificate["spec"]["dnsNames"]
    issuer = rendered.one("Issuer")
    assert certificate["spec"]["issuerRef"] == {
        "name": issuer["metadata"]["name"],
        "kind": "Issuer",
        "group": "cert-manager.io",
    }
    for kind in ("ValidatingWebhookConfiguration", "MutatingWebhookConfiguration"):
        config = rendered.one(kind)
        assert config["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == (
            f"{NAMESPACE}/{certificate['metadata']['name']}"
        )
        assert all("caBundle" not in w["clientConfig"] for w in config["webhooks"])


def test_cert_manager_with_the_clusters_issuer_creates_no_issuer() -> None:
    rendered = render_configuration("cert-manager-issuer")
    assert rendered.of_kind("Issuer") == []
    spec = rendered.one("Certificate")["spec"]
    assert spec["issuerRef"] == {"name": "internal-ca", "kind": "ClusterIssuer", "group": "cert-manager.io"}
    assert spec["duration"] == "720h"


# -- RBAC: exactly the README's table ---------------------------------------------------------------------------------


def documented_permissions(values: dict[str, Any]) -> tuple[set[tuple[str, str, str]], set[tuple[str, str, str]]]:
    """(namespaced, cluster) ``(group, resource, verb)`` grants the README's "Permissions" table gives ``values``."""
    readme = (CHART / "README.md").read_text()
    table = readme.split("## Permissions", 1)[1].split("\n## ", 1)[0]
    operator = values.get("operator", {})
    conditions = {
        "always": True,
        "`operator.namespaces`": bool(operator.get("namespaces")),
        "`operator.peering` and `operator.namespaces`": bool(operator.get("peering") and operator.get("namespaces")),
        "`operator.peering` without `operator.namespaces`": bool(
            operator.get("peering") and not operator.get("namespaces")
        ),
    }
    grants: dict[str, set[tuple[str, str, str]]] = {"namespaced": set(), "cluster": set()}
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    assert rows
    for row in rows:
        group, resources, verbs, scope, when, _why = (cell.strip() for cell in row.strip("|").split("|"))
        if not conditions[when]:
            continue
        for resource in resources.split(","):
            for verb in verbs.split(","):
                grants[scope].add((group.strip("`").strip('"'), resource.strip().strip("`"), verb.strip()))
    return grants["namespaced"], grants["cluster"]


def granted(role: dict[str, Any]) -> set[tuple[str, str, str]]:
    return {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


@pytest.mark.parametrize("configuration", CONFIGURATIONS)
def test_rbac_is_exactly_the_documented_list(configuration: str) -> None:
    values = ci_values(configuration)
    rendered = render_configuration(configuration)
    namespaced, cluster = documented_permissions(values)
    watched = values.get("operator", {}).get("namespaces", [])
    cluster_role = granted(rendered.one("ClusterRole"))
    if watched:
        assert cluster_role == cluster
        roles = rendered.of_kind("Role")
        assert sorted(r["metadata"]["namespace"] for r in roles) == sorted(watched)
        for role in roles:
            assert granted(role) == namespaced
    else:
        assert cluster_role == cluster | namespaced
        assert rendered.of_kind("Role") == []
    account = rendered.one("Deployment")["spec"]["template"]["spec"]["serviceAccountName"]
    for binding in rendered.of_kind("ClusterRoleBinding") + rendered.of_kind("RoleBinding"):
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE}]


def test_rbac_grants_no_wildcards_no_secrets_no_webhook_configurations() -> None:
    for configuration in CONFIGURATIONS:
        rendered = render_configuration(configuration)
        for role in rendered.of_kind("ClusterRole") + rendered.of_kind("Role"):
            for group, resource, verb in granted(role):
                assert "*" not in (group, resource, verb)
                assert resource != "secrets"
                assert group != "admissionregistration.k8s.io"


def test_peered_replicas_keep_one_operator_through_a_drain() -> None:
    assert render().of_kind("PodDisruptionBudget") == []  # one replica: a budget would block every drain
    rendered = render_configuration("custom")
    budget = rendered.one("PodDisruptionBudget")
    assert budget["spec"]["minAvailable"] == 1
    labels = rendered.one("Deployment")["spec"]["template"]["metadata"]["labels"]
    assert budget["spec"]["selector"]["matchLabels"].items() <= labels.items()

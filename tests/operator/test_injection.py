"""The pod webhook's patch, as pure data: applied with an independent RFC 6902 implementation (jsonpatch) to pods
written here, and read back by the real sidecar and SDK settings code, which must find a full identity in it.
"""

from __future__ import annotations

import copy
from typing import Any

import jsonpatch
import pytest

from meshscope.jobs import load_spec
from meshscope.sdk import TrackerSettings
from meshscope.topology import parse_layout
from meshscope_operator import injection
from meshscope_operator.injection import (
    INJECTED_ANNOTATION,
    InjectionTarget,
    Outcome,
    Source,
    injection_for,
    target_from_body,
    target_from_spec,
)
from meshscope_operator.settings import OperatorSettings
from meshscope_sidecar import identity as sidecar_identity
from meshscope_sidecar import settings as sidecar_settings
from operator_serving import ROOT, STORED_JOBS, labelled_pod

SETTINGS = OperatorSettings(sidecar_image="img:1")
TARGET = InjectionTarget(job="llama", layout="dp=16,tp=8,pp=4,cp=1,ep=1,vpp=5", gpus_per_node=8)


def _inject(pod: dict[str, Any], target: InjectionTarget | str | None = TARGET) -> tuple[dict[str, Any], Any]:
    result = injection_for(pod, target, SETTINGS)
    return jsonpatch.apply_patch(copy.deepcopy(pod), [dict(op) for op in result.patch]), result


def _env(container: dict[str, Any], resolve: dict[str, str] | None = None) -> dict[str, str]:
    """A container's environment as the kubelet gives it: fieldRefs resolved from ``resolve``."""
    out = {}
    for e in container.get("env", []):
        if "value" in e:
            out[e["name"]] = e["value"]
        else:
            out[e["name"]] = (resolve or {})[e["valueFrom"]["fieldRef"]["fieldPath"]]
    return out


def test_target_of_an_example_is_its_layout_and_gpus_per_node() -> None:
    spec = load_spec(ROOT / "examples" / "llama3-70b-h100.yaml")
    target = target_from_spec(spec)
    assert target.job == "llama3-70b-h100"
    assert target.gpus_per_node == 8
    assert parse_layout(target.layout, world_size=512) == spec.layout  # what the sidecar and the SDK will parse
    assert target.sources == frozenset(Source)


def test_target_of_a_job_that_does_not_load_is_the_loader_message() -> None:
    message = target_from_body(STORED_JOBS["tp3"])
    assert isinstance(message, str)
    assert message.startswith("spec.parallelism: tp*pp*cp = 3*1*1 = 3 does not divide the world size 512")


def test_the_injected_sidecar_resolves_a_full_identity_with_the_real_sidecar_code(tmp_path) -> None:
    pod = labelled_pod("llama")
    pod["metadata"]["labels"]["batch.kubernetes.io/job-completion-index"] = "3"
    injected, result = _inject(pod)
    assert result.outcome is Outcome.INJECTED
    sidecar = injected["spec"]["initContainers"][0]
    env = _env(sidecar, {"spec.nodeName": "gpu-node-17", "status.hostIP": "10.0.0.17"})
    # The downward API's labels file at the path the sidecar is told (here under tmp_path: the kubelet would mount
    # it at /etc/meshscope/podinfo), one key="value" per label (kubernetes pkg/fieldpath FormatMap).
    assert env["MESHSCOPE_POD_LABELS_FILE"] == "/etc/meshscope/podinfo/labels"
    labels_file = tmp_path / "labels"
    labels_file.write_text("".join(f'{k}="{v}"\n' for k, v in sorted(pod["metadata"]["labels"].items())))
    env["MESHSCOPE_POD_LABELS_FILE"] = str(labels_file)
    parsed = sidecar_settings.settings_from([], env)
    ident = sidecar_identity.resolve_identity(parsed.identity)
    assert ident.mode is sidecar_identity.IdentityMode.FULL, ident.missing
    # Node rank 3 with 8 GPUs per node holds ranks 24..31 on GPUs 0..7.
    assert [(g.gpu, g.rank) for g in ident.gpus] == [(i, 24 + i) for i in range(8)]
    assert ident.node == "gpu-node-17"
    assert parsed.port == 9402
    assert parsed.sockets == ("unix:/run/meshscope/records.sock",)


def test_the_training_container_is_set_up_for_the_sdk() -> None:
    injected, _ = _inject(labelled_pod("llama"))
    env = _env(injected["spec"]["containers"][0], {"spec.nodeName": "gpu-node-17"})
    env |= {"RANK": "25", "WORLD_SIZE": "512", "LOCAL_RANK": "1"}  # what torchrun sets
    tracker = TrackerSettings.from_env(env)
    assert tracker.problems == ()
    assert tracker.job == "llama"
    assert tracker.collector == "unix:/run/meshscope/records.sock"
    assert tracker.node == "gpu-node-17"
    assert tracker.layout == parse_layout("dp=16,tp=8,pp=4,vpp=5")
    assert env["NCCL_DEBUG"] == "INFO"
    assert env["NCCL_DEBUG_SUBSYS"] == "INIT"  # COLL, a line per collective, is opt-in
    assert env["NCCL_DEBUG_FILE"] == "/var/log/meshscope/nccl/nccl.%h.%p"


def test_the_sidecar_is_a_hardened_native_sidecar() -> None:
    injected, _ = _inject(labelled_pod("llama"))
    sidecar = injected["spec"]["initContainers"][0]
    assert sidecar["restartPolicy"] == "Always"
    ctx = sidecar["securityContext"]
    assert ctx["runAsNonRoot"] is True
    assert ctx["runAsUser"] == 65532  # sidecar/Dockerfile USER 65532:65532
    assert ctx["readOnlyRootFilesystem"] is True
    assert ctx["allowPrivilegeEscalation"] is False
    assert ctx["capabilities"] == {"drop": ["ALL"]}
    assert sidecar["resources"] == {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "512Mi"}}
    mounts = {m["name"]: m for m in sidecar["volumeMounts"]}
    assert mounts["meshscope-nccl-logs"]["readOnly"] is True
    volumes = {v["name"]: v for v in injected["spec"]["volumes"]}
    # no hostPath (Pod Security's baseline and restricted levels refuse one): the counters come from the
    # sidecar's own sysfs
    assert not [v for v in injected["spec"]["volumes"] if "hostPath" in v]
    assert volumes["meshscope-run"] == {"name": "meshscope-run", "emptyDir": {}}
    assert volumes["meshscope-podinfo"]["downwardAPI"]["items"] == [
        {"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}}
    ]
    env = _env(sidecar, {"spec.nodeName": "n", "status.hostIP": "10.1.2.3"})
    assert env["MESHSCOPE_SIDECAR_INFINIBAND_ROOT"] == "/sys/class/infiniband"
    assert env["MESHSCOPE_SIDECAR_NCCL_LOGS"] == "/var/log/meshscope/nccl"
    # $(MESHSCOPE_HOST_IP) is expanded by the kubelet from the variable defined before it
    names = [e["name"] for e in sidecar["env"]]
    assert names.index("MESHSCOPE_HOST_IP") < names.index("MESHSCOPE_SIDECAR_DCGM_URL")
    assert env["MESHSCOPE_SIDECAR_DCGM_URL"] == "http://$(MESHSCOPE_HOST_IP):9400/metrics"


def test_existing_init_containers_run_after_the_sidecar_and_user_settings_are_kept() -> None:
    pod = labelled_pod("llama")
    pod["spec"]["initContainers"] = [{"name": "fetch-data", "image": "busybox"}]
    trainer = pod["spec"]["containers"][0]
    trainer["env"].append({"name": "NCCL_DEBUG", "value": "WARN"})
    pod["metadata"]["annotations"] = {"owner": "team-a"}
    injected, result = _inject(pod)
    assert [c["name"] for c in injected["spec"]["initContainers"]] == ["meshscope-sidecar", "fetch-data"]
    env = _env(injected["spec"]["containers"][0], {"spec.nodeName": "n"})
    assert env["NCCL_DEBUG"] == "WARN"  # the user's choice stands
    assert [e["name"] for e in injected["spec"]["containers"][0]["env"]].count("NCCL_DEBUG") == 1
    assert injected["metadata"]["annotations"] == {"owner": "team-a", INJECTED_ANNOTATION: "img:1"}
    assert result.warnings == ()


def test_a_users_nccl_debug_file_and_a_taken_mount_path_are_kept_with_a_warning() -> None:
    pod = labelled_pod("llama")
    trainer = pod["spec"]["containers"][0]
    trainer["env"].append({"name": "NCCL_DEBUG_FILE", "value": "/logs/nccl.%h"})
    trainer["volumeMounts"].append({"name": "scratch", "mountPath": "/run/meshscope"})
    injected, result = _inject(pod)
    env = _env(injected["spec"]["containers"][0], {"spec.nodeName": "n"})
    assert env["NCCL_DEBUG_FILE"] == "/logs/nccl.%h"
    mounts = injected["spec"]["containers"][0]["volumeMounts"]
    assert [m["mountPath"] for m in mounts].count("/run/meshscope") == 1  # a second one would make the pod invalid
    assert result.warnings == (
        (
            "meshscope: container 'trainer' sets NCCL_DEBUG_FILE='/logs/nccl.%h'; the sidecar reads NCCL logs from "
            "/var/log/meshscope/nccl, so it sees none of this container's"
        ),
        (
            "meshscope: container 'trainer' already mounts something at /run/meshscope; the sidecar's meshscope-run "
            "volume is not mounted there"
        ),
    )


def test_a_pod_without_env_mounts_volumes_or_annotations_gets_the_lists_made() -> None:
    pod = {
        "metadata": {"generateName": "w-", "namespace": "ns", "labels": {"meshscope.io/trainingjob": "llama"}},
        "spec": {"containers": [{"name": "t", "image": "x"}]},
    }
    injected, result = _inject(pod)
    assert result.outcome is Outcome.INJECTED
    assert [v["name"] for v in injected["spec"]["volumes"]] == [
        "meshscope-run",
        "meshscope-podinfo",
        "meshscope-nccl-logs",
    ]
    assert [m["name"] for m in injected["spec"]["containers"][0]["volumeMounts"]] == [
        "meshscope-run",
        "meshscope-nccl-logs",
    ]
    assert injected["metadata"]["annotations"] == {INJECTED_ANNOTATION: "img:1"}


def test_injection_is_idempotent() -> None:
    injected, _ = _inject(labelled_pod("llama"))
    again = injection_for(injected, TARGET, SETTINGS)
    assert again.outcome is Outcome.ALREADY_INJECTED
    assert again.patch == ()
    # a pod that has a container of the sidecar's name (made by the operator's own Job) is left alone too
    pod = labelled_pod("llama")
    pod["spec"]["initContainers"] = [{"name": "meshscope-sidecar", "image": "mine"}]
    assert injection_for(pod, TARGET, SETTINGS).outcome is Outcome.ALREADY_INJECTED


@pytest.mark.parametrize(
    ("pod_change", "outcome"),
    [
        (lambda p: p["spec"].update(containers=[]), Outcome.UNPATCHABLE),
        (lambda p: p["spec"].update(volumes={"a": 1}), Outcome.UNPATCHABLE),
        (lambda p: p.pop("spec"), Outcome.UNPATCHABLE),
        (lambda p: p["spec"].update(initContainers="x"), Outcome.UNPATCHABLE),
    ],
    ids=["no-containers", "volumes-not-a-list", "no-spec", "init-not-a-list"],
)
def test_a_pod_that_cannot_take_the_sidecar_is_left_alone_with_a_warning(pod_change, outcome) -> None:
    pod = labelled_pod("llama")
    pod_change(pod)
    result = injection_for(pod, TARGET, SETTINGS)
    assert result.outcome is outcome
    assert result.patch == ()
    (warning,) = result.warnings
    assert warning.startswith("meshscope: pod 'worker-0' cannot take the sidecar: ")


def test_no_trainingjob_or_a_bad_one_means_no_sidecar_and_a_bounded_warning() -> None:
    result = injection_for(labelled_pod("llama"), None, SETTINGS)
    assert (result.outcome, result.patch) == (Outcome.NO_TRAININGJOB, ())
    result = injection_for(labelled_pod("llama"), "spec.x: " + "y" * 1000 + "\n", SETTINGS)
    assert result.outcome is Outcome.INVALID_TRAININGJOB
    (warning,) = result.warnings
    assert len(warning) == 256
    assert warning.endswith("…")
    assert "\n" not in warning


def test_sources_decide_the_wiring() -> None:
    target = InjectionTarget(job="j", layout="dp=8", gpus_per_node=8, sources=frozenset({Source.DCGM}))
    injected, _ = _inject(labelled_pod("j"), target)
    env = _env(injected["spec"]["initContainers"][0], {"spec.nodeName": "n", "status.hostIP": "h"})
    assert "MESHSCOPE_SIDECAR_NVML" not in env  # dcgm on: NVML left to the sidecar's auto
    assert env["MESHSCOPE_SIDECAR_INFINIBAND"] == "off"
    assert "MESHSCOPE_COLLECTOR" not in _env(injected["spec"]["containers"][0], {"spec.nodeName": "n"})
    no_dcgm = OperatorSettings(dcgm_url="")
    result = injection_for(labelled_pod("j"), target, no_dcgm)
    sidecar = result.patch[0]["value"][0]  # type: ignore[index]
    assert "MESHSCOPE_SIDECAR_DCGM_URL" not in {e["name"] for e in sidecar["env"]}


def test_every_injected_variable_is_one_the_sidecar_or_the_sdk_reads() -> None:
    names = {
        v
        for module in (sidecar_settings, sidecar_identity)
        for k, v in vars(module).items()
        if k.startswith("ENV_") and isinstance(v, str)
    }
    if "MESHSCOPE_SIDECAR_NCCL_LOGS" not in names:
        pytest.skip("the sidecar's source settings (issue 10: NCCL logs, InfiniBand, DCGM, NVML) are not merged yet")
    injected, _ = _inject(labelled_pod("llama"))
    ours = {"MESHSCOPE_HOST_IP"}  # the operator's own, for $(MESHSCOPE_HOST_IP) in the DCGM URL
    for e in injected["spec"]["initContainers"][0]["env"]:
        assert e["name"] in names | ours, e["name"]
    sdk = {"MESHSCOPE_JOB", "MESHSCOPE_LAYOUT", "MESHSCOPE_NODE", "MESHSCOPE_COLLECTOR"}
    nccl = {"NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "NCCL_DEBUG_FILE"}
    for e in injected["spec"]["containers"][0]["env"][1:]:  # [0] is the pod's own NCCL_IB_HCA
        assert e["name"] in sdk | nccl


def test_the_injection_module_names_match_the_sidecar_defaults() -> None:
    assert sidecar_settings.DEFAULT_SOCKET == injection.SOCKET
    assert SETTINGS.sidecar_port == sidecar_settings.DEFAULT_PORT
    assert sidecar_identity.COMPLETION_INDEX_LABEL == "batch.kubernetes.io/job-completion-index"


def _qos(pod: dict[str, Any]) -> str:
    """The pod's QoS class by Kubernetes' rules (kubernetes/pkg/apis/core/v1/helper/qos), written out here."""
    units = {"m": 1e-3, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "": 1}

    def number(text: str) -> float:
        suffix = next(u for u in ("Ki", "Mi", "Gi", "m", "") if text.endswith(u))
        return float(text[: len(text) - len(suffix)] if suffix else text) * units[suffix]

    containers = pod["spec"]["containers"] + pod["spec"].get("initContainers", [])
    limited = all(all(r in c.get("resources", {}).get("limits", {}) for r in ("cpu", "memory")) for c in containers)
    equal = all(
        number(c["resources"].get("requests", c["resources"]["limits"]).get(r, c["resources"]["limits"][r]))
        == number(c["resources"]["limits"][r])
        for c in containers
        for r in ("cpu", "memory")
    ) if limited else False  # fmt: skip
    return "Guaranteed" if equal else "Burstable"


@pytest.mark.parametrize(
    ("resources", "qos"),
    [
        (
            {"requests": {"cpu": "96", "memory": "1600Gi"}, "limits": {"cpu": "96000m", "memory": "1600Gi"}},
            "Guaranteed",
        ),
        ({"limits": {"cpu": "96", "memory": "1600Gi", "nvidia.com/gpu": "8"}}, "Guaranteed"),
        ({"requests": {"cpu": "48", "memory": "800Gi"}, "limits": {"cpu": "96", "memory": "1600Gi"}}, "Burstable"),
    ],
    ids=["requests-equal-limits", "limits-only", "burstable"],
)
def test_a_guaranteed_pod_stays_guaranteed(resources: dict[str, Any], qos: str) -> None:
    # GPU nodes run the static CPU manager and the Topology Manager: only a Guaranteed pod's containers get
    # exclusive cores aligned with their GPUs and NICs. The sidecar (requests below its limits) made it Burstable.
    pod = labelled_pod("llama")
    pod["spec"]["containers"][0]["resources"] = resources
    assert _qos(pod) == qos
    injected, _ = _inject(pod)
    assert _qos(injected) == qos
    sidecar = injected["spec"]["initContainers"][0]
    if qos == "Burstable":  # nothing to keep: the sidecar's own requests and limit
        assert sidecar["resources"] == {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "512Mi"}}

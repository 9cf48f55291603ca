"""Both admission webhooks through kopf's real WebhookServer over HTTPS, with AdmissionReview v1 requests.

TrainingJobs: every example is admitted with the findings worked out by hand below (the same, word for word, as
``meshscope plan --json`` gives, cut to the API server's 256 characters); every manifest in
tests/data/operator/denied/ is denied with 422 and the message ``meshscope plan FILE`` prints. Pods: a labelled pod
gets the sidecar as a JSON patch; an unlabelled one, one already injected, and one whose TrainingJob is missing,
invalid or has monitoring off get none, and a warning where there is something to say.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import json
from typing import TYPE_CHECKING, Any

import jsonpatch
import pytest
import yaml

from meshscope import cli
from meshscope_operator.admission import live_target
from meshscope_operator.injection import InjectionTarget, injection_for
from meshscope_operator.kubeapi import KubeApi
from operator_serving import NAMESPACE, ROOT, labelled_pod, load_example, training_job

if TYPE_CHECKING:
    from pathlib import Path

DENIED = sorted((ROOT / "tests" / "data" / "operator" / "denied").glob("*.yaml"))

# Per example, the finding codes in order and, for each, numbers worked out by hand from the example's spec.
EXPECTED_FINDINGS: dict[str, list[tuple[str, list[str]]]] = {
    # 16 nodes x 8 = 128 GPUs, tp 16: 128 / 16 = 8 TP groups, each over 16 / 8 = 2 nodes (H100: one node per
    # NVLink domain); the H100's 989 TFLOP/s over a 400 Gb/s NIC (50 GB/s) is a budget of 19,780 FLOPs per byte.
    "bad-tp16-h100": [
        ("tp-crosses-nvlink-domain", ["tp=16 groups span 2 NVLink domains (8 GPUs each)", "8 of 8 TP groups"]),
        ("flops-per-byte-below-budget", ["tp all-gather + reduce-scatter over network"]),
    ],
    # 288 x 8 = 2304 GPUs, pp 9: dp = 256, m = 4608 / 256 = 18 micro-batches, bubble 8/18; ep 64 out of dp 256:
    # 2304 / 64 = 36 EP groups of 64 / 8 = 8 nodes; 2304 / 9 = 256 PP groups; FP8 budget 1,979 / 50 = 39,580.
    "deepseek-v3-h100": [
        ("ep-all-to-all-over-network", ["ep=64 all-to-all", "36 of 36 EP groups (up to 8 NVLink domains"]),
        ("bubble-large", ["(pp-1)/m = 8/18 with pp=9 and 18 micro-batches (1f1b)"]),
        ("flops-per-byte-below-budget", ["ep all-to-all over network"]),
        ("pp-over-network", ["pp=9", "256 of 256 PP groups (up to 9 NVLink domains"]),
    ],
    # 1024 x 8 = 8192 GPUs, pp 8: 1024 PP groups over 8 nodes; B200 NVLink 900 GB/s per direction.
    "llama3-405b-b200": [("pp-over-network", ["pp=8", "1024 of 1024 PP groups", "instead of 900 GB/s"])],
    "llama3-405b-gb200-nvl72": [],
    # 2048 x 8 = 16384 GPUs, dp 128 tp 8 pp 16 vpp 4: m = 2048 / 128 = 16, bubble 15/(16*4); 16384 / 16 = 1024 PP
    # groups; an H100 has 80 GiB and the example reserves none.
    "llama3-405b-h100": [
        ("memory-exceeds-hbm", ["80.0 GiB of HBM is usable"]),
        ("bubble-large", ["(pp-1)/(m·vpp) = 15/(16·4) with pp=16 and 16 micro-batches (interleaved)"]),
        ("pp-over-network", ["pp=16", "1024 of 1024 PP groups (up to 16 NVLink domains"]),
    ],
    # 32 x 8 = 256 GPUs, tp 4 pp 2: 128 PP groups over 2 nodes.
    "llama3-70b-b200": [("pp-over-network", ["pp=2", "128 of 128 PP groups (up to 2 NVLink domains"])],
    # 64 x 8 = 512 GPUs, pp 4: 128 PP groups over 4 nodes.
    "llama3-70b-h100": [("pp-over-network", ["pp=4", "128 of 128 PP groups (up to 4 NVLink domains"])],
    "llama3-8b-b200": [],
    "llama3-8b-h100": [],
    # 16 x 8 = 128 GPUs, pp 4: dp 32, m = 256 / 32 = 8, bubble 3/8; 32 PP groups over 4 nodes; ep 8 inside a node.
    "mixtral-8x7b-h100": [
        ("bubble-large", ["(pp-1)/m = 3/8 with pp=4 and 8 micro-batches (1f1b)"]),
        ("pp-over-network", ["pp=4", "32 of 32 PP groups (up to 4 NVLink domains"]),
    ],
}


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_every_example_has_its_expectations() -> None:
    assert sorted(EXPECTED_FINDINGS) == sorted(p.stem for p in (ROOT / "examples").glob("*.yaml"))


@pytest.mark.parametrize("name", sorted(EXPECTED_FINDINGS), ids=str)
def test_example_is_admitted_with_the_planner_findings_as_warnings(served, capsys, name: str) -> None:
    response = served.review_job(load_example(name))
    assert response["allowed"] is True, response
    assert "status" not in response
    warnings = response.get("warnings", [])
    expected = EXPECTED_FINDINGS[name]
    shown = [w for w in warnings if not w.startswith("meshscope: ")]
    assert [w.split(":", 1)[0].removesuffix(" (error)") for w in shown] == [code for code, _ in expected]
    for text, (code, facts) in zip(shown, expected, strict=True):
        for fact in facts:
            assert fact in text, (code, fact, text)
        assert len(text) <= 256
    # The same findings as `meshscope plan --json`, each cut to 256 characters with an ellipsis.
    code, out, _ = _cli(capsys, "plan", "--json", str(ROOT / "examples" / f"{name}.yaml"))
    assert code == 0
    findings = json.loads(out)["findings"]
    for text, f in zip(shown, findings, strict=True):
        full = f"{f['code']}{' (error)' if f['severity'] == 'error' else ''}: {f['message']}"
        assert text == (full if len(full) <= 256 else full[:255] + "…")
    cut = sum(1 for f in findings if len(f["code"]) + 2 + len(f["message"]) > 256)
    if cut:
        assert warnings[-1] == (
            f"meshscope: {len(findings)} findings in all ({cut} cut short); "
            "`meshscope plan` on this manifest prints every one in full"
        )
    else:
        assert len(warnings) == len(findings)


def test_bad_placement_warns_that_tp_groups_cross_the_network(served) -> None:
    response = served.review_job(load_example("bad-tp16-h100"))
    assert response["allowed"] is True
    assert response["warnings"][0].startswith(
        "tp-crosses-nvlink-domain: tp=16 groups span 2 NVLink domains (8 GPUs each): 8 of 8 TP groups cross the "
        "network at 50 GB/s instead of 450 GB/s"
    )


@pytest.mark.parametrize("path", DENIED, ids=lambda p: p.stem)
def test_impossible_spec_is_denied_with_the_message_of_meshscope_plan(served, capsys, path: Path) -> None:
    response = served.review_job(yaml.safe_load(path.read_text()))
    assert response["allowed"] is False
    assert response["status"]["code"] == 422
    code, _, err = _cli(capsys, "plan", str(path))
    assert code == 2
    assert err == f"meshscope: error: {response['status']['message']}\n"


@pytest.mark.parametrize(
    ("name", "message"),
    [
        (
            "dp-mismatch",
            (
                "spec.parallelism: dp(8)*tp(8)*pp(4)*cp(1) = 256 != world size 512 (64 nodes x 8 GPUs); with "
                "tp*pp*cp = 32, dp = 16 fits (or leave dp out)"
            ),
        ),
        ("pp3-layers", "spec.model.layers: model.layers (80) is not divisible by pp*vpp (3*1)"),
        ("batch-1000", "not divisible by microBatchSize*dp (1*64 = 64); use a multiple of 64, e.g. 960 or 1024"),
        ("few-microbatches", "= 32/(1*16) = 2 < pp (4): the 1F1B schedule needs m >= pp"),
        ("tp128-heads", "model.heads (64) is not divisible by tp (128); use tp among 1, 2, 4, 8, 16, 32, 64"),
        ("unknown-key", "unknown key 'tensorParallel' in spec.parallelism; did you mean 'tp'?"),
    ],
    ids=lambda v: v if "/" not in v and " " not in v else "",
)
def test_denial_names_the_numbers_that_do_not_fit(served, name: str, message: str) -> None:
    path = ROOT / "tests" / "data" / "operator" / "denied" / f"{name}.yaml"
    response = served.review_job(yaml.safe_load(path.read_text()))
    assert message in response["status"]["message"]


def test_update_that_leaves_the_spec_alone_is_admitted_even_if_the_spec_is_bad(served) -> None:
    bad = yaml.safe_load((ROOT / "tests" / "data" / "operator" / "denied" / "dp-mismatch.yaml").read_text())
    labelled = copy.deepcopy(bad)
    labelled["metadata"]["labels"] = {"team": "llm"}
    labelled["metadata"]["finalizers"] = []
    response = served.review_job(labelled, operation="UPDATE", old=bad)
    assert response["allowed"] is True
    assert "warnings" not in response
    # ... but an update that changes the spec is checked
    changed = copy.deepcopy(bad)
    changed["spec"]["parallelism"]["pp"] = 2
    response = served.review_job(changed, operation="UPDATE", old=bad)
    assert response["allowed"] is False
    assert "dp(8)*tp(8)*pp(2)*cp(1) = 128 != world size 512" in response["status"]["message"]


def test_an_object_being_deleted_is_admitted(served) -> None:
    bad = yaml.safe_load((ROOT / "tests" / "data" / "operator" / "denied" / "dp-mismatch.yaml").read_text())
    deleting = copy.deepcopy(bad)
    deleting["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    deleting["spec"]["parallelism"]["dp"] = 3  # even a spec change: the object is on its way out
    assert served.review_job(deleting, operation="UPDATE", old=bad)["allowed"] is True


def test_generate_name_is_checked_as_the_name_it_will_get(served) -> None:
    job = load_example("llama3-8b-h100")
    del job["metadata"]["name"]
    job["metadata"]["generateName"] = "llama-"
    assert served.review_job(job)["allowed"] is True
    job["metadata"]["generateName"] = "Llama_"  # not a DNS name: neither is what the server would make of it
    response = served.review_job(job)
    assert response["allowed"] is False
    assert response["status"]["message"].startswith("metadata.name: 'Llama_00000' is not a DNS subdomain name")


def test_a_job_beyond_the_planning_bound_is_admitted_unplanned(served) -> None:
    # 40,000 nodes x 8 = 320,000 GPUs > the default bound of 262,144; the arithmetic still holds (dp = 40,000).
    job = training_job(
        "huge",
        {
            "model": {"preset": "llama3-8b"},
            "parallelism": {"tp": 8},
            "training": {"microBatchSize": 1, "globalBatchSize": 40_000},
            "hardware": {"gpu": "H100", "nodes": 40_000},
        },
    )
    response = served.review_job(job)
    assert response["allowed"] is True
    assert response["warnings"] == [
        (
            "meshscope: not planned on admission: 320,000 GPUs is above this operator's bound of 262,144 "
            "(MESHSCOPE_OPERATOR_MAX_PLANNED_GPUS); the spec loads and its layout arithmetic holds; `meshscope plan` on "
            "this manifest plans it"
        )
    ]
    job["spec"]["training"]["globalBatchSize"] = 40_001  # the loader still runs: 40,001 is not a multiple of 40,000
    assert served.review_job(job)["allowed"] is False


def test_a_review_that_is_not_json_is_a_bad_request_not_a_crash(served) -> None:
    status, _ = served.post("trainingjobs", b"{not json")
    assert status == 400


# ---------------------------------------------------------------------------------------------------- pods


def _patched(pod: dict[str, Any], response: dict[str, Any]) -> dict[str, Any]:
    assert response["allowed"] is True
    assert response["patchType"] == "JSONPatch"
    ops = json.loads(base64.b64decode(response["patch"]))
    return jsonpatch.apply_patch(pod, ops)


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def test_labelled_pod_gets_the_native_sidecar(served) -> None:
    pod = labelled_pod("llama3-70b-h100")
    response = served.review_pod(pod)
    assert "warnings" not in response
    injected = _patched(pod, response)
    (sidecar,) = injected["spec"]["initContainers"]
    assert sidecar["name"] == "meshscope-sidecar"
    assert sidecar["restartPolicy"] == "Always"  # a native sidecar (KEP-753)
    assert sidecar["image"] == "registry.example/meshscope-sidecar:test"
    env = _env(sidecar)
    assert env["MESHSCOPE_JOB"] == "llama3-70b-h100"
    assert env["MESHSCOPE_LAYOUT"] == "dp=16,tp=8,pp=4,cp=1,ep=1,vpp=5"  # the example's layout
    assert env["MESHSCOPE_GPUS_PER_NODE"] == "8"
    assert env["MESHSCOPE_NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    (trainer,) = injected["spec"]["containers"]
    tenv = _env(trainer)
    assert tenv["MESHSCOPE_COLLECTOR"] == "unix:/run/meshscope/records.sock"
    assert tenv["NCCL_DEBUG"] == "INFO"
    assert tenv["NCCL_IB_HCA"] == "mlx5"  # the user's own variable is kept
    assert {m["mountPath"] for m in trainer["volumeMounts"]} == {"/data", "/run/meshscope", "/var/log/meshscope/nccl"}
    assert {v["name"] for v in injected["spec"]["volumes"]} == {
        "data",
        "meshscope-run",
        "meshscope-nccl-logs",
        "meshscope-podinfo",
    }
    assert injected["metadata"]["annotations"] == {
        "meshscope.io/sidecar-injected": "registry.example/meshscope-sidecar:test"
    }


def test_an_injected_pod_is_left_as_it_is(served) -> None:
    pod = labelled_pod("llama3-70b-h100")
    injected = _patched(pod, served.review_pod(pod))
    again = served.review_pod(injected)
    assert again["allowed"] is True
    assert "patch" not in again
    assert "warnings" not in again


def test_pod_without_the_label_is_not_touched(served) -> None:
    response = served.review_pod(labelled_pod(None))
    assert response == {"uid": response["uid"], "allowed": True}


def test_pod_of_a_missing_trainingjob_runs_without_sidecar_and_a_warning(served) -> None:
    response = served.review_pod(labelled_pod("no-such-job"))
    assert response["allowed"] is True
    assert "patch" not in response
    assert response["warnings"] == [
        (
            f"meshscope: no TrainingJob 'no-such-job' in namespace '{NAMESPACE}' (label meshscope.io/trainingjob); "
            "pod 'worker-0' runs without the meshscope sidecar"
        )
    ]


def test_a_trainingjob_the_index_does_not_hold_is_read_from_the_api(served) -> None:
    # A standby replica of a peered operator serves the webhooks while kopf keeps its watches paused: its index is
    # empty, and every pod it admitted ran without the sidecar. The webhook now reads such a TrainingJob.
    async def read() -> tuple[object, object]:
        api = KubeApi(served.api_url)
        try:
            return await live_target(api, NAMESPACE, "llama3-70b-h100"), await live_target(api, NAMESPACE, "nope")
        finally:
            await api.close()

    found, missing = asyncio.run(read())
    assert missing is None
    assert isinstance(found, InjectionTarget)
    from_index = _patched(labelled_pod("llama3-70b-h100"), served.review_pod(labelled_pod("llama3-70b-h100")))
    ops = [dict(op) for op in injection_for(labelled_pod("llama3-70b-h100"), found, served.settings).patch]
    assert jsonpatch.apply_patch(labelled_pod("llama3-70b-h100"), ops) == from_index


def test_pod_of_an_invalid_trainingjob_gets_the_loader_message(served) -> None:
    response = served.review_pod(labelled_pod("tp3"))
    assert response["allowed"] is True
    assert "patch" not in response
    (warning,) = response["warnings"]
    assert warning.startswith("meshscope: TrainingJob 'tp3' does not load (spec.")
    assert "tp*pp*cp = 3*1*1 = 3 does not divide the world size 512" in warning  # dp left out: 512 / 3
    assert len(warning) <= 256


def test_pod_of_a_job_with_monitoring_off_is_not_injected(served) -> None:
    response = served.review_pod(labelled_pod("quiet"))
    assert response == {"uid": response["uid"], "allowed": True}


def test_pod_of_a_train_only_job_gets_no_nccl_or_infiniband_wiring(served) -> None:
    pod = labelled_pod("train-only", containers=2)
    injected = _patched(pod, served.review_pod(pod))
    env = _env(injected["spec"]["initContainers"][0])
    assert env["MESHSCOPE_SIDECAR_INFINIBAND"] == "off"
    assert env["MESHSCOPE_SIDECAR_NVML"] == "off"
    assert "MESHSCOPE_SIDECAR_NCCL_LOGS" not in env
    assert "MESHSCOPE_SIDECAR_DCGM_URL" not in env
    for trainer in injected["spec"]["containers"]:
        assert "NCCL_DEBUG" not in _env(trainer)
        assert _env(trainer)["MESHSCOPE_COLLECTOR"] == "unix:/run/meshscope/records.sock"
    assert {v["name"] for v in injected["spec"]["volumes"]} == {"data", "meshscope-run", "meshscope-podinfo"}


def test_pod_webhook_fails_open_when_meshscope_breaks(served, monkeypatch) -> None:
    from meshscope_operator import admission  # noqa: PLC0415

    def broken(*_: Any) -> None:
        raise RuntimeError("a bug in meshscope")

    monkeypatch.setattr(admission, "injection_for", broken)
    response = served.review_pod(labelled_pod("llama3-70b-h100"))
    assert response["allowed"] is True
    assert "patch" not in response
    assert response["warnings"] == [admission.FAILED_OPEN]


def test_trainingjob_webhook_fails_closed_when_meshscope_breaks(served, monkeypatch) -> None:
    from meshscope_operator import admission  # noqa: PLC0415

    def broken(*_: Any, **__: Any) -> None:
        raise RuntimeError("a bug in meshscope")

    monkeypatch.setattr(admission, "review_training_job", broken)
    response = served.review_job(load_example("llama3-8b-h100"))
    assert response["allowed"] is False
    assert response["status"] == {"message": "a bug in meshscope", "code": 500}

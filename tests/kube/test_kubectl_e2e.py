"""What a user sees through the real kubectl: the CRD, admission warnings and denials, the sidecar, printer columns,
describe, and the kubectl plugin, against the emulated API server with the operator serving its webhooks.

Expected texts come from independent paths: the CRD file (columns), the planner run here (the finding's words), the
layout arithmetic done by hand (denials), ``meshscope analyze`` / ``meshscope plan`` run as commands (the plugin).
"""

from __future__ import annotations

import json
import re
import ssl
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from kube_emulator.tables import column_definitions
from kube_serving import CRD_FILE, NAMESPACE, Cluster, wait_reconciled, write
from meshscope.jobs import load_spec
from meshscope.plan import plan_job
from meshscope_operator.kubectl_plugin import COST_TABLE_KEY
from operator_serving import TIMEOUT_S, Served, labelled_pod

ROOT = Path(__file__).resolve().parents[2]
BAD = "examples/bad-tp16-h100.yaml"
GOOD = "examples/llama3-70b-h100.yaml"
RECORDS = "tests/data/pp2_tp2_dp2_straggler/records.jsonl"


def _columns(text: str) -> list[list[str]]:
    """kubectl's table output as rows of cells (cells are separated by at least two spaces)."""
    return [re.split(r"\s{2,}", line.strip()) for line in text.strip().splitlines()]


def _crd_columns(*, wide: bool) -> list[str]:
    crd = yaml.safe_load((ROOT / CRD_FILE).read_text())
    declared = crd["spec"]["versions"][0]["additionalPrinterColumns"]
    return [c["name"].upper() for c in column_definitions(declared) if wide or c["priority"] == 0]


def _reviews(cluster: Cluster) -> list[tuple[str, str, str]]:
    return cluster.api.call(lambda e: [(r.webhook, r.operation, r.resource) for r in e.reviews])


def _meshscope(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "meshscope", *args], capture_output=True, text=True, cwd=ROOT, timeout=120, check=True
    )


def test_the_crd_applies_and_is_established(cluster: Cluster) -> None:
    assert cluster.crd_applied.returncode == 0, cluster.crd_applied.stderr
    assert (
        cluster.crd_applied.stdout
        == "customresourcedefinition.apiextensions.k8s.io/trainingjobs.meshscope.io created\n"
    )
    done = cluster.kubectl.run(
        "get",
        "crd",
        "trainingjobs.meshscope.io",
        "-o",
        "jsonpath={.status.conditions[?(@.type=='Established')].status}",
    )
    assert done.stdout == "True"
    # Discovery now maps the short name: a second apply of the same file changes nothing.
    again = cluster.kubectl.run("apply", "--validate=false", "-f", CRD_FILE)
    assert again.stdout == "customresourcedefinition.apiextensions.k8s.io/trainingjobs.meshscope.io unchanged\n"


def test_applying_the_bad_placement_example_prints_the_planners_warning(cluster: Cluster, operator) -> None:
    done = cluster.kubectl.run("apply", "--validate=false", "-f", BAD)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "trainingjob.meshscope.io/bad-tp16-h100 created\n"
    # tp 16 on nodes of 8 GPUs: every TP group spans 2 nodes (NVLink domains), by hand.
    assert "Warning: tp-crosses-nvlink-domain: tp=16 groups span 2 NVLink domains (8 GPUs each)" in done.stderr
    top = plan_job(load_spec(ROOT / BAD)).findings[0]
    assert f"Warning: {top.code}: {top.message}" in done.stderr.splitlines()
    assert ("trainingjobs.meshscope.io", "CREATE", "trainingjobs") in _reviews(cluster)


def test_a_layout_that_does_not_fit_is_denied_with_the_numbers(cluster: Cluster, operator, tmp_path) -> None:
    spec = yaml.safe_load((ROOT / GOOD).read_text())
    spec["metadata"] = {"name": "wrong-dp"}
    spec["spec"]["hardware"]["nodes"] = 16  # 128 GPUs
    spec["spec"]["parallelism"] = {"dp": 8, "tp": 8, "pp": 4}  # 8 * 8 * 4 = 256
    done = cluster.kubectl.run(
        "apply", "--validate=false", "-f", str(write(tmp_path, "wrong.yaml", yaml.safe_dump(spec)))
    )
    assert done.returncode == 1
    assert 'admission webhook "trainingjobs.meshscope.io" denied the request' in done.stderr
    # 256 ranks for 128 GPUs; tp*pp*cp = 32, so dp = 128 / 32 = 4 would fit.
    assert "= 256 != world size 128 (16 nodes x 8 GPUs)" in done.stderr
    assert "dp = 4 fits" in done.stderr
    gone = cluster.kubectl.run("get", "tj", "wrong-dp")
    assert gone.returncode == 1
    assert 'trainingjobs.meshscope.io "wrong-dp" not found' in gone.stderr


def test_a_spec_the_schema_refuses_never_reaches_the_webhook(cluster: Cluster, operator, tmp_path) -> None:
    spec = yaml.safe_load((ROOT / GOOD).read_text())
    spec["metadata"] = {"name": "zero-tp"}
    spec["spec"]["parallelism"] = {"tp": 0}
    before = len(_reviews(cluster))
    done = cluster.kubectl.run(
        "apply", "--validate=false", "-f", str(write(tmp_path, "zero.yaml", yaml.safe_dump(spec)))
    )
    assert done.returncode == 1
    assert (
        'The TrainingJob "zero-tp" is invalid: spec.parallelism.tp: Invalid value: 0: '
        "spec.parallelism.tp in body should be greater than or equal to 1"
    ) in done.stderr
    assert len(_reviews(cluster)) == before  # schema validation runs before validating admission


def _wait_for_index(operator, job: str) -> None:
    """Until the operator's pod webhook knows ``job`` (kopf indexes TrainingJobs from its watch)."""
    served = Served(
        base_url=f"https://127.0.0.1:{operator.webhook_port}",
        context=ssl.create_default_context(cafile=operator.webhook_ca_file),
        settings=operator,
        mock=None,
    )
    deadline = time.monotonic() + TIMEOUT_S
    while "patch" not in served.review_pod(labelled_pod(job)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the operator did not index TrainingJob {job} within {TIMEOUT_S} s")
        time.sleep(0.05)


def test_a_labelled_pod_created_with_kubectl_gets_the_sidecar(cluster: Cluster, operator, tmp_path) -> None:
    assert cluster.kubectl.run("apply", "--validate=false", "-f", GOOD).returncode == 0
    _wait_for_index(operator, "llama3-70b-h100")
    pod = labelled_pod("llama3-70b-h100", name="worker-0")
    plain = labelled_pod(None, name="plain-0")
    for p in (pod, plain):
        p["metadata"].pop("namespace")
    created = cluster.kubectl.run(
        "create", "--validate=false", "-f", str(write(tmp_path, "pods.yaml", yaml.safe_dump_all([pod, plain])))
    )
    assert created.returncode == 0, created.stderr
    assert created.stdout == "pod/worker-0 created\npod/plain-0 created\n"
    stored = json.loads(cluster.kubectl.run("get", "pod", "worker-0", "-o", "json", check=True).stdout)
    sidecar = stored["spec"]["initContainers"][0]
    assert sidecar["name"] == "meshscope-sidecar"
    assert sidecar["restartPolicy"] == "Always"  # a native sidecar
    assert sidecar["image"] == operator.sidecar_image
    assert [c["name"] for c in stored["spec"]["containers"]] == ["trainer"]
    assert stored["metadata"]["annotations"]["meshscope.io/sidecar-injected"] == operator.sidecar_image
    untouched = json.loads(cluster.kubectl.run("get", "pod", "plain-0", "-o", "json", check=True).stdout)
    assert "initContainers" not in untouched["spec"]
    # The objectSelector kept the unlabelled pod away from the webhook.
    assert [r for r in _reviews(cluster) if r[0] == "sidecar.meshscope.io"] == [
        ("sidecar.meshscope.io", "CREATE", "pods")
    ]


STATUS = {  # what the cost tiers add (another slice of issue 11 writes them; this test stands in for it)
    "phase": "Running",
    "stepTimeSeconds": 12.5,
    "topCost": "exposed comm tp (41%)",
}


def test_get_tj_prints_the_crds_printer_columns_with_values_from_status(cluster: Cluster, operator) -> None:
    reconciled = {name: wait_reconciled(cluster, name)["status"] for name in ("bad-tp16-h100", "llama3-70b-h100")}
    header, row = _columns(cluster.kubectl.run("get", "tj", "bad-tp16-h100", check=True).stdout)
    assert header == _crd_columns(wide=False)
    assert header == ["NAME", "LAYOUT", "WORLD", "PHASE", "STEP", "TOP COST", "FINDINGS", "AGE"]
    # Written by reconcile: tp 16 on 16 nodes x 8 GPUs = 128 ranks, dp = 128 / 16 = 8 (by hand).
    assert row[:4] == ["bad-tp16-h100", "dp8-tp16", "128", reconciled["bad-tp16-h100"]["phase"]]
    patched = cluster.kubectl.run(
        "patch", "tj", "bad-tp16-h100", "--subresource=status", "--type=merge", "-p", json.dumps({"status": STATUS})
    )
    assert patched.returncode == 0, patched.stderr
    assert patched.stdout == "trainingjob.meshscope.io/bad-tp16-h100 patched\n"
    header, row = _columns(cluster.kubectl.run("get", "tj", "bad-tp16-h100", check=True).stdout)
    findings = str(reconciled["bad-tp16-h100"]["findings"])
    assert row[:-1] == ["bad-tp16-h100", "dp8-tp16", "128", "Running", "12.5", "exposed comm tp (41%)", findings]
    assert re.fullmatch(r"\d+s|\d+m\d*s?", row[-1])  # the Age column, as the API server renders a date
    wide = _columns(cluster.kubectl.run("get", "tj", "-o", "wide", check=True).stdout)
    assert wide[0] == _crd_columns(wide=True)
    names = [r[0] for r in wide[1:]]
    assert names == ["bad-tp16-h100", "llama3-70b-h100"]  # the list is sorted by name
    # llama3-70b-h100: 64 nodes x 8 GPUs = 512 ranks, tp 8 pp 4, dp = 512 / 32 = 16; no step time nor top cost yet:
    # the server sends null cells and kubectl prints them blank.
    llama = reconciled["llama3-70b-h100"]
    assert wide[2][:-1] == ["llama3-70b-h100", "dp16-tp8-pp4", "512", llama["phase"], str(llama["findings"])]
    by_category = _columns(cluster.kubectl.run("get", "meshscope", check=True).stdout)  # the CRD's category
    assert [r[0] for r in by_category[1:]] == names
    everywhere = _columns(cluster.kubectl.run("get", "tj", "-A", check=True).stdout)
    assert everywhere[0][:2] == ["NAMESPACE", "NAME"]
    assert everywhere[1][:3] == [NAMESPACE, "bad-tp16-h100", "dp8-tp16"]


def test_a_field_the_crd_does_not_declare_is_pruned_with_kubectls_warning(cluster: Cluster, operator) -> None:
    done = cluster.kubectl.run("patch", "tj", "bad-tp16-h100", "--type=merge", "-p", '{"spec": {"bogus": 1}}')
    assert done.returncode == 0, done.stderr
    assert done.stderr == 'Warning: unknown field "spec.bogus"\n'
    assert done.stdout == "trainingjob.meshscope.io/bad-tp16-h100 patched (no change)\n"


def test_describe_tj_shows_spec_and_status(cluster: Cluster, operator) -> None:
    text = cluster.kubectl.run("describe", "tj", "bad-tp16-h100", check=True).stdout
    assert re.search(r"^Name:\s+bad-tp16-h100$", text, re.MULTILINE)
    assert re.search(rf"^Namespace:\s+{NAMESPACE}$", text, re.MULTILINE)
    assert re.search(r"^Kind:\s+TrainingJob$", text, re.MULTILINE)
    status = text[text.index("\nStatus:\n") :]
    for label, value in (("Layout", "dp8-tp16"), ("Phase", "Running"), ("Top Cost", "exposed comm tp (41%)")):
        assert re.search(rf"^  {label}:\s+{re.escape(value)}$", status, re.MULTILINE), (label, status)
    assert re.search(r"^    Tp:\s+16$", text, re.MULTILINE)  # the spec, as applied


def _costs_config_map(cluster: Cluster, tmp_path: Path, name: str, text: str) -> None:
    # A manifest, not `kubectl create configmap --from-file`: that generator sends protobuf, which the emulator
    # does not decode.
    manifest = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}, "data": {COST_TABLE_KEY: text}}
    path = write(tmp_path, f"{name}.yaml", yaml.safe_dump(manifest))
    done = cluster.kubectl.run("create", "--validate=false", "-f", str(path))
    assert done.returncode == 0, done.stderr


def _point_at(cluster: Cluster, job: str, ref: str) -> None:
    patch = json.dumps({"status": {"costTableRef": ref}})
    cluster.kubectl.run("patch", "tj", job, "--subresource=status", "--type=merge", "-p", patch, check=True)


def test_kubectl_meshscope_cost_prints_the_table_meshscope_analyze_prints(cluster: Cluster, operator, tmp_path) -> None:
    data = _meshscope("analyze", RECORDS, "--json", "--quiet").stdout
    expected = _meshscope("analyze", RECORDS, "--quiet").stdout
    _costs_config_map(cluster, tmp_path, "bad-tp16-h100-costs", data)
    _point_at(cluster, "bad-tp16-h100", "bad-tp16-h100-costs")
    done = cluster.kubectl.run("meshscope", "cost", "bad-tp16-h100", "-n", NAMESPACE)
    assert done.returncode == 0, done.stderr
    assert done.stdout == expected
    assert "Cost table (per step" in done.stdout
    # The printer columns still come from status, untouched by the plugin.
    assert _columns(cluster.kubectl.run("get", "tj", "bad-tp16-h100", check=True).stdout)[1][1] == "dp8-tp16"


@pytest.mark.parametrize(
    ("job", "setup", "message"),
    [
        ("no-such-job", None, "kubectl meshscope: error: no TrainingJob 'no-such-job' in namespace 'training'"),
        (
            "llama3-70b-h100",
            None,
            (
                "kubectl meshscope: error: TrainingJob training/llama3-70b-h100 has no status.costTableRef yet: the "
                "operator's deep tier has not run for it"
            ),
        ),
        (
            "llama3-70b-h100",
            ("missing-costs", None),
            (
                "kubectl meshscope: error: ConfigMap training/missing-costs (status.costTableRef of TrainingJob "
                "llama3-70b-h100) not found"
            ),
        ),
        (
            "llama3-70b-h100",
            ("garbage-costs", '{"job": "x"}'),
            (
                "kubectl meshscope: error: ConfigMap training/garbage-costs (status.costTableRef of TrainingJob "
                "llama3-70b-h100): data key 'analysis.json' is not a meshscope cost table (KeyError: 'summary')"
            ),
        ),
    ],
    ids=["no-job", "no-ref-yet", "no-config-map", "not-a-table"],
)
def test_kubectl_meshscope_cost_fails_with_one_line(cluster: Cluster, operator, tmp_path, job, setup, message) -> None:
    if setup is not None:
        ref, text = setup
        if text is not None:
            _costs_config_map(cluster, tmp_path, ref, text)
        _point_at(cluster, job, ref)
    done = cluster.kubectl.run("meshscope", "cost", job, "-n", NAMESPACE)
    assert done.returncode == 1
    assert done.stdout == ""
    assert done.stderr.startswith(message), done.stderr
    assert done.stderr.count("\n") == 1


def test_kubectl_meshscope_plan_prints_what_meshscope_plan_prints(cluster: Cluster) -> None:
    done = cluster.kubectl.run("meshscope", "plan", BAD)
    assert done.returncode == 0, done.stderr
    assert done.stdout == _meshscope("plan", BAD).stdout
    broken = cluster.kubectl.run("meshscope", "plan", "examples/no-such.yaml")
    assert broken.returncode == 2
    assert broken.stderr.startswith("kubectl meshscope: error: ")
    assert broken.stderr.count("\n") == 1

"""The recording rules (sidecar/monitoring/recording-rules.yaml) on real stores.

- ``promtool check rules`` accepts the file and ``promtool test rules`` passes the hand-written unit tests
  (tests/data/sidecar/recording-rules/unit-tests.yaml), which cover every rule, per-rank and aggregate, and catch a
  median computed as a mean.
- The file's two levels hold their shape: per-rank rules read the sidecars' counters only and keep every label of a
  rank; aggregates keep only closed-set labels and read only per-rank series recorded earlier in their own group
  (the same evaluation on Prometheus), or node-level series.
- A real Prometheus scrapes the synthetic job of :mod:`promstack` (8 ranks on two sidecars, counters growing at known
  rates) every second, evaluates the rules every second, and every recorded series, per rank and aggregate, has the
  label set and the value derived by hand below. The aggregates' values are the ones derived before the per-rank
  level existed: their meaning did not change.
- A real VictoriaMetrics scrapes the same job itself, and vmalert evaluates the same file against it and writes back.
  Every rule's expression, evaluated through VictoriaMetrics' ``/api/v1/query``, gives Prometheus' series: the
  per-rank expressions from the raw counters (where the two stores' rate() differ, if anywhere), the aggregates from
  the per-rank series vmalert recorded; and what vmalert records is Prometheus' series too.

Tolerances follow from the stores, not from timing: every per-rank ratio divides two rates of one rank from one
scrape, so the window's edges cancel. Prometheus keeps float64 samples exactly; what is left is float rounding of
counters near 1e3-1e7 differenced over >= 1 s (< 1e-12 relative). VictoriaMetrics stores values with 12 significant
decimal digits: a counter of value V growing at r per second loses up to V x 1e-12 of an increase of r per second,
and the worst counter here is ``other``'s (300 s of warm-up + 12 s of history at 0.012 s/s: 2.6e-8 of one second's
increase), twice in a ratio, so 1e-6 relative; the per-rank series vmalert writes back are rounded to 12 digits once
more (1e-12). Rules that are absolute per-second rates (the sources' parse errors, drops and polling time) differ
between the stores while the series are younger than the window (Prometheus extrapolates, VictoriaMetrics does not),
so the live tests check those as exactly zero or positive; their values are checked exactly by promtool.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml

from meshscope_sidecar.metrics import BY_NAME
from meshscope_sidecar.settings import DEFAULT_PORT
from sidecar.promstack import (
    JOB,
    Service,
    _start,
    binary,
    http_get,
    start_prometheus,
    start_victoria_metrics,
    start_vmalert,
    synthetic_job,
)

if TYPE_CHECKING:
    from collections.abc import Iterator

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "sidecar" / "monitoring" / "recording-rules.yaml"
UNIT_TESTS = ROOT / "tests" / "data" / "sidecar" / "recording-rules" / "unit-tests.yaml"
SCRAPE_CONFIG = ROOT / "sidecar" / "monitoring" / "scrape-config.yaml"

PROMETHEUS_REL_TOL = 1e-9
VICTORIA_REL_TOL = 1e-6
POSITIVE = "positive"
"""An absolute per-second rate that must be > 0 (its counter grows); 0.0 means its counter is flat."""


def rules() -> list[dict[str, str]]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def L(**labels: str) -> frozenset[tuple[str, str]]:
    return frozenset({"job": JOB, **labels}.items())


def R(rank: int, **labels: str) -> frozenset[tuple[str, str]]:
    """A per-rank series' labels (``instance``, the exposition's port, left out: :func:`by_labels` drops it).

    promstack's job in Megatron's tp-cp-ep-dp-pp order: rank = tp + 2 x dp + 4 x pp; node-0 holds stage 0 on GPUs
    0-3 and node-1 stage 1.
    """
    coords = {"rank": str(rank), "dp": str(rank // 2 % 2), "tp": str(rank % 2), "pp": str(rank // 4)}
    where = {"node": f"node-{rank // 4}", "nvlink_domain": "nvl-a", "network_tier": "leaf-1", "gpu": str(rank % 4)}
    return L(**coords, cp="0", ep="0", **where, **labels)


# ---- hand-derived values for promstack's synthetic job ------------------------------------------------------------
# Per rank, seconds per step in each category (promstack's scenario, written out): stage 0 (ranks 0-3) and stage 1
# (4-7); rank 2 waits 0.15 s on data and 0.1 s on dp, rank 5 computes 1.6 s and waits on nobody's dp.
CATEGORIES = (
    ("compute", ""),
    ("exposed_comm", "tp"),
    ("exposed_comm", "dp"),
    ("exposed_comm", "pp"),
    ("bubble", ""),
    ("data", ""),
    ("optimizer", ""),
    ("checkpoint", ""),
    ("other", ""),
)
_ST0 = (1.2, 0.1, 0.2, 0.05, 0.25, 0.05, 0.1, 0.02, 0.03)
_ST1 = (1.3, 0.1, 0.3, 0.05, 0.1, 0.05, 0.1, 0.02, 0.03)
SECONDS_PER_STEP = {
    0: _ST0,
    1: _ST0,
    2: (1.2, 0.1, 0.1, 0.05, 0.25, 0.15, 0.1, 0.02, 0.03),
    3: _ST0,
    4: _ST1,
    5: (1.6, 0.1, 0.0, 0.05, 0.1, 0.05, 0.1, 0.02, 0.03),
    6: _ST1,
    7: _ST1,
}
STEP_S = {0: 2.0, 1: 2.0, 2: 2.0, 3: 2.0, 4: 2.05, 5: 2.05, 6: 2.05, 7: 2.05}
OWN_S = {0: 1.4, 1: 1.4, 2: 1.5, 3: 1.4, 4: 1.5, 5: 1.8, 6: 1.5, 7: 1.5}  # step - exposed comm - bubble
UTILIZATION_RATIO = {0: 0.97, 1: 0.97, 2: 0.97, 3: 0.97, 4: 0.98, 5: 0.99, 6: 0.98, 7: 0.98}
SM_ACTIVE_RATIO = {r: 0.7 if r < 4 else 0.75 for r in range(8)}
TENSOR_ACTIVE_RATIO = {r: 0.4 if r < 4 else 0.45 for r in range(8)}
TOKENS_PER_STEP = {r: 24576.0 if r == 2 else 16384.0 for r in range(8)}
ATTENTION_WORK_PER_STEP = {r: 24576.0 * 8192 if r == 2 else 16384.0 * 4096 for r in range(8)}

# Seconds per step: stage 0 (ranks 0-3) 2.0 each, stage 1 (ranks 4-7) 2.05 each. Own time: 1.4, 1.4, 1.5 (rank 2's
# heavy batch), 1.4 | 1.5, 1.8 (rank 5, the straggler), 1.5, 1.5. quantile(0.5) over n values interpolates at
# index 0.5 x (n - 1) of the sorted values: 1.5 for 4, 3.5 for 8.
S0, S1 = 2.0, 2.05
# Per-rank share of a category = its seconds per step / the rank's step time; job shares average the 8 ranks:
#   compute:      4 x 1.2/2.0 + (3 x 1.3 + 1.6)/2.05       -> (2.4 + 5.5/2.05) / 8
#   exposed tp:   4 x 0.1/2.0 + 4 x 0.1/2.05               -> (0.2 + 0.4/2.05) / 8
#   exposed dp:   (3 x 0.2 + 0.1)/2.0 + (3 x 0.3 + 0)/2.05 -> (0.35 + 0.9/2.05) / 8
#   exposed pp:   4 x 0.05/2.0 + 4 x 0.05/2.05            -> (0.1 + 0.2/2.05) / 8
#   bubble:       4 x 0.25/2.0 + 4 x 0.1/2.05             -> (0.5 + 0.4/2.05) / 8
#   data:         (3 x 0.05 + 0.15)/2.0 + 4 x 0.05/2.05   -> (0.15 + 0.2/2.05) / 8
#   optimizer:    (0.2 + 0.4/2.05) / 8;  checkpoint: (0.04 + 0.08/2.05) / 8;  other: (0.06 + 0.12/2.05) / 8
# The stage-0 numerators add up to 4.0 (4 ranks x 1) and the stage-1 ones to 8.2/2.05 = 4.0: the shares sum to 1.
JOB_SHARES = {
    ("compute", ""): (2.4 + 5.5 / S1) / 8,
    ("exposed_comm", "tp"): (0.2 + 0.4 / S1) / 8,
    ("exposed_comm", "dp"): (0.35 + 0.9 / S1) / 8,
    ("exposed_comm", "pp"): (0.1 + 0.2 / S1) / 8,
    ("bubble", ""): (0.5 + 0.4 / S1) / 8,
    ("data", ""): (0.15 + 0.2 / S1) / 8,
    ("optimizer", ""): (0.2 + 0.4 / S1) / 8,
    ("checkpoint", ""): (0.04 + 0.08 / S1) / 8,
    ("other", ""): (0.06 + 0.12 / S1) / 8,
}
# Stage 0: every rank's step is 2.0 s; rank 2 has dp 0.1 and data 0.15 instead of 0.2 and 0.05.
# Stage 1: every rank's step is 2.05 s; rank 5 has compute 1.6 and dp 0 instead of 1.3 and 0.3.
PP_SHARES = {
    ("0", "compute", ""): 1.2 / S0,
    ("0", "exposed_comm", "tp"): 0.1 / S0,
    ("0", "exposed_comm", "dp"): (3 * 0.2 + 0.1) / 4 / S0,
    ("0", "exposed_comm", "pp"): 0.05 / S0,
    ("0", "bubble", ""): 0.25 / S0,
    ("0", "data", ""): (3 * 0.05 + 0.15) / 4 / S0,
    ("0", "optimizer", ""): 0.1 / S0,
    ("0", "checkpoint", ""): 0.02 / S0,
    ("0", "other", ""): 0.03 / S0,
    ("1", "compute", ""): (3 * 1.3 + 1.6) / 4 / S1,
    ("1", "exposed_comm", "tp"): 0.1 / S1,
    ("1", "exposed_comm", "dp"): 3 * 0.3 / 4 / S1,
    ("1", "exposed_comm", "pp"): 0.05 / S1,
    ("1", "bubble", ""): 0.1 / S1,
    ("1", "data", ""): 0.05 / S1,
    ("1", "optimizer", ""): 0.1 / S1,
    ("1", "checkpoint", ""): 0.02 / S1,
    ("1", "other", ""): 0.03 / S1,
}
UTILIZATION = (4 * 0.97 + 3 * 0.98 + 0.99) / 8  # 0.97625


def _cat(category: str, axis: str) -> dict[str, str]:
    return {"category": category, "axis": axis} if axis else {"category": category}


def _per_rank(values: dict[int, float]) -> dict[frozenset[tuple[str, str]], float | str]:
    return {R(r): v for r, v in values.items()}


def _per_rank_shares() -> dict[frozenset[tuple[str, str]], float | str]:
    """Each rank's seconds per step by category over its step time."""
    return {
        R(r, **_cat(c, a)): seconds / STEP_S[r]
        for r, row in SECONDS_PER_STEP.items()
        for (c, a), seconds in zip(CATEGORIES, row, strict=True)
    }


EXPECTED: dict[str, dict[frozenset[tuple[str, str]], float | str]] = {
    "rank:meshscope_step_seconds:mean_rate5m": _per_rank(STEP_S),
    # 2.0 x 4 then 2.05 x 4: halfway between the 4th and the 5th
    "job:meshscope_step_seconds:median_rate5m": {L(): (2.0 + 2.05) / 2},
    "job:meshscope_step_seconds:max_rate5m": {L(): 2.05},
    "job_pp:meshscope_step_seconds:median_rate5m": {L(pp="0"): 2.0, L(pp="1"): 2.05},
    "job_pp:meshscope_step_seconds:max_rate5m": {L(pp="0"): 2.0, L(pp="1"): 2.05},
    "rank:meshscope_own_seconds:mean_rate5m": _per_rank(OWN_S),
    # own, sorted: stage 0 1.4 1.4 1.4 1.5; stage 1 1.5 1.5 1.5 1.8
    "job_pp:meshscope_own_seconds:median_rate5m": {L(pp="0"): 1.4, L(pp="1"): 1.5},
    "job_pp:meshscope_own_seconds:max_rate5m": {L(pp="0"): 1.5, L(pp="1"): 1.8},
    "job_pp:meshscope_straggler_gap_seconds:rate5m": {L(pp="0"): 1.5 - 1.4, L(pp="1"): 1.8 - 1.5},
    "job:meshscope_straggler_gap_seconds:max_rate5m": {L(): 1.8 - 1.5},
    "rank_category_axis:meshscope_breakdown_share:ratio_rate5m": _per_rank_shares(),
    "rank:meshscope_gpu_utilization_ratio:avg5m": _per_rank(UTILIZATION_RATIO),
    "rank:meshscope_gpu_sm_active_ratio:avg5m": _per_rank(SM_ACTIVE_RATIO),
    "rank:meshscope_gpu_tensor_active_ratio:avg5m": _per_rank(TENSOR_ACTIVE_RATIO),
    # exposed dp per rank: 0.2 0.2 0.1 0.2 | 0.3 0 0.3 0.3 -> job 1.6/8, stages 0.7/4 and 0.9/4
    "job_axis:meshscope_exposed_comm_seconds:mean_rate5m": {
        L(axis="tp"): 0.1,
        L(axis="dp"): 1.6 / 8,
        L(axis="pp"): 0.05,
    },
    "job_pp_axis:meshscope_exposed_comm_seconds:mean_rate5m": {
        L(pp="0", axis="tp"): 0.1,
        L(pp="0", axis="dp"): 0.7 / 4,
        L(pp="0", axis="pp"): 0.05,
        L(pp="1", axis="tp"): 0.1,
        L(pp="1", axis="dp"): 0.9 / 4,
        L(pp="1", axis="pp"): 0.05,
    },
    "job_pp:meshscope_bubble_seconds:mean_rate5m": {L(pp="0"): 0.25, L(pp="1"): 0.1},
    "job_category_axis:meshscope_breakdown_share:ratio_rate5m": {
        L(**_cat(c, a)): v for (c, a), v in JOB_SHARES.items()
    },
    "job_pp_category_axis:meshscope_breakdown_share:ratio_rate5m": {
        L(pp=pp, **_cat(c, a)): v for (pp, c, a), v in PP_SHARES.items()
    },
    # 24 h x the sum over the 8 ranks of the share = 24 x 8 x the job's mean share; all categories: 8 GPUs x 24 h
    "job_category_axis:meshscope_breakdown_gpu_hours_per_day:sum_rate5m": {
        L(**_cat(c, a)): 24 * 8 * v for (c, a), v in JOB_SHARES.items()
    },
    "job:meshscope_gpu_utilization_ratio:avg5m": {L(): UTILIZATION},
    "job:meshscope_gpu_sm_active_ratio:avg5m": {L(): (4 * 0.7 + 4 * 0.75) / 8},
    "job:meshscope_gpu_tensor_active_ratio:avg5m": {L(): (4 * 0.4 + 4 * 0.45) / 8},
    "job:meshscope_compute_share:ratio_rate5m": {L(): JOB_SHARES["compute", ""]},
    # the mean of (utilisation - compute share) is the difference of the means
    "job:meshscope_utilization_gap:ratio_rate5m": {L(): UTILIZATION - JOB_SHARES["compute", ""]},
    "rank:meshscope_data_tokens_per_step:mean_rate5m": _per_rank(TOKENS_PER_STEP),
    "rank:meshscope_data_attention_work_per_step:mean_rate5m": _per_rank(ATTENTION_WORK_PER_STEP),
    # tokens per step: 16384 on every rank but rank 2 (24576, as 3 sequences of 8192; the others 4 of 4096)
    "job:meshscope_data_tokens_per_step:median_rate5m": {L(): 16384.0},
    "job:meshscope_data_tokens_per_step:max_rate5m": {L(): 24576.0},
    "job:meshscope_data_attention_work_per_step:median_rate5m": {L(): 16384.0 * 4096},
    "job:meshscope_data_attention_work_per_step:max_rate5m": {L(): 24576.0 * 8192},
    # node-1's dcgm-exporter is down; its NCCL log has garbage; node-0's training source drops records
    "job_source:meshscope_source_up:ratio": {
        L(source="train_events"): 1.0,
        L(source="dcgm"): 0.5,
        L(source="nccl_log"): 1.0,
    },
    "job_source:meshscope_source_up:count": {
        L(source="train_events"): 2.0,
        L(source="dcgm"): 2.0,
        L(source="nccl_log"): 2.0,
    },
    "job_source:meshscope_source_parse_errors:rate5m": {
        L(source="train_events"): 0.0,
        L(source="dcgm"): 0.0,
        L(source="nccl_log"): POSITIVE,
    },
    "job_source:meshscope_source_dropped:rate5m": {
        L(source="train_events"): POSITIVE,
        L(source="dcgm"): 0.0,
        L(source="nccl_log"): 0.0,
    },
    "job_source:meshscope_source_poll_seconds:max_rate5m": {
        L(source="train_events"): POSITIVE,
        L(source="dcgm"): POSITIVE,
        L(source="nccl_log"): POSITIVE,
    },
}
ABSOLUTE_RATES = {name for name, series in EXPECTED.items() if POSITIVE in series.values()}


def by_labels(result: list[dict[str, Any]]) -> dict[frozenset[tuple[str, str]], float]:
    # `instance` is the exposition's loopback port, another every run; `settled` counts the series, so two that
    # differ only in it would not go unseen
    out = {}
    for sample in result:
        labels = frozenset((k, v) for k, v in sample["metric"].items() if k not in {"__name__", "instance"})
        out[labels] = float(sample["value"][1])
    return out


def settled(store: Service, expr: str, series: int) -> dict[frozenset[tuple[str, str]], float]:
    """The query's result once it has ``series`` series: a scrape that times out under load writes staleness markers,
    and a gauge read raw is absent until the next scrape (a second later)."""
    result: list[dict[str, Any]] = []

    def complete() -> bool:
        nonlocal result
        result = store.query(expr)
        return len(result) == series

    with contextlib.suppress(pytest.fail.Exception):
        store.wait_for(f"{series} series of {expr}", complete, timeout_s=10)
    return by_labels(result)


def check_value(got: float, want: float | str, *, rel: float, what: str) -> None:
    if want == POSITIVE:
        assert got > 0, f"{what}: {got}, expected > 0"
    else:
        assert isinstance(want, float)
        assert math.isclose(got, want, rel_tol=rel, abs_tol=rel * 1e-3), f"{what}: {got}, expected {want}"


def run_promtool(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [binary("promtool"), *map(str, args)], capture_output=True, text=True, timeout=60, check=False
    )


# ---- promtool -------------------------------------------------------------------------------------------------


def test_promtool_check_rules_accepts_every_rule() -> None:
    proc = run_promtool("check", "rules", RULES)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(rules())} rules found" in proc.stdout


def test_promtool_unit_tests_pass() -> None:
    proc = run_promtool("test", "rules", UNIT_TESTS)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout + proc.stderr


def test_every_rule_has_a_unit_test() -> None:
    tested = " ".join(
        t["expr"] for case in yaml.safe_load(UNIT_TESTS.read_text())["tests"] for t in case["promql_expr_test"]
    )
    untested = [r["record"] for r in rules() if not re.search(rf"(?<![\w:]){re.escape(r['record'])}(?![\w:])", tested)]
    assert not untested, f"rules without a promtool unit test: {untested}"


def test_promtool_unit_tests_catch_a_median_computed_as_a_mean(tmp_path: Path) -> None:
    # the unit tests must be able to fail: the job's median step time written as an average (2.1875, not 2.125)
    doc = yaml.safe_load(RULES.read_text())
    (rule,) = [
        r for g in doc["groups"] for r in g["rules"] if r["record"] == "job:meshscope_step_seconds:median_rate5m"
    ]
    assert "quantile by (job) (0.5," in rule["expr"]
    rule["expr"] = rule["expr"].replace("quantile by (job) (0.5,", "avg by (job) (")
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(doc))
    tests = yaml.safe_load(UNIT_TESTS.read_text())
    tests["rule_files"] = ["rules.yaml"]
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(tests))
    proc = run_promtool("test", "rules", tmp_path / "tests.yaml")
    assert proc.returncode != 0
    assert "job:meshscope_step_seconds:median_rate5m" in proc.stdout + proc.stderr
    assert "2.1875E+00" in proc.stdout + proc.stderr


# ---- the scrape config the chart ships ----------------------------------------------------------------------


def without_kubernetes_discovery(entry: dict[str, Any]) -> dict[str, Any]:
    """The scrape config with its Kubernetes discovery replaced by static targets: Debian's Prometheus is built
    without the Kubernetes service discovery (it refuses ``kubernetes_sd_configs``), so the tests check the rest."""
    assert entry.pop("kubernetes_sd_configs") == [{"role": "pod"}]
    return entry | {"static_configs": [{"targets": ["127.0.0.1:9"]}]}


def test_the_scrape_config_and_the_rules_make_a_valid_prometheus_config(tmp_path: Path) -> None:
    (entry,) = yaml.safe_load(SCRAPE_CONFIG.read_text())
    config = {"rule_files": [str(RULES)], "scrape_configs": [without_kubernetes_discovery(entry)]}
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    proc = run_promtool("check", "config", tmp_path / "prometheus.yml")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(rules())} rules found" in proc.stdout


def test_the_scrape_config_keeps_the_sidecars_job_label() -> None:
    (entry,) = yaml.safe_load(SCRAPE_CONFIG.read_text())
    assert entry["honor_labels"] is True


def test_the_scrape_config_finds_the_native_sidecar_and_nothing_else(tmp_path: Path) -> None:
    # A real Prometheus relabels discovered targets: the pod role's meta labels are given here by a static config
    # (Prometheus drops every `__` label after relabeling, as it does the discovered ones). Kept: the sidecar, an
    # init container (a native sidecar), on its port; dropped: the training container, and the sidecar on another
    # port.
    (entry,) = yaml.safe_load(SCRAPE_CONFIG.read_text())
    entry = without_kubernetes_discovery(entry)

    def pod(address: str, container: str, port: int, *, init: bool) -> dict[str, object]:
        meta = {
            "__meta_kubernetes_namespace": "team-a",
            "__meta_kubernetes_pod_name": "llama-0",
            "__meta_kubernetes_pod_container_name": container,
            "__meta_kubernetes_pod_container_port_number": str(port),
            "__meta_kubernetes_pod_container_init": str(init).lower(),
        }
        return {"targets": [address], "labels": meta}

    entry["static_configs"] = [
        pod("127.0.0.1:9", "meshscope-sidecar", DEFAULT_PORT, init=True),
        pod("127.0.0.2:9", "trainer", 8080, init=False),
        pod("127.0.0.3:9", "meshscope-sidecar", 9403, init=True),
    ]
    config_path = tmp_path / "prometheus.yml"
    config_path.write_text(yaml.safe_dump({"scrape_configs": [entry]}))
    argv = [
        binary("prometheus"),
        f"--config.file={config_path}",
        f"--storage.tsdb.path={tmp_path / 'data'}",
        "--log.level=warn",
    ]
    with _start(
        "prometheus", lambda port: [*argv, f"--web.listen-address=127.0.0.1:{port}"], tmp_path, "/-/ready"
    ) as p:
        targets: dict[str, Any] = {}

        def discovered() -> bool:
            nonlocal targets
            targets = json.loads(http_get(p.url + "/api/v1/targets"))["data"]
            return len(targets["activeTargets"]) + len(targets["droppedTargets"]) == 3

        p.wait_for("the three targets", discovered)
    (active,) = targets["activeTargets"]
    assert active["labels"] == {
        "instance": "127.0.0.1:9",
        "job": "meshscope-sidecar",
        "namespace": "team-a",
        "pod": "llama-0",
    }
    dropped = {t["discoveredLabels"]["__address__"] for t in targets["droppedTargets"]}
    assert dropped == {"127.0.0.2:9", "127.0.0.3:9"}


# ---- the rules' shape -----------------------------------------------------------------------------------------

BOUNDED_LABELS = {"job", "pp", "axis", "category", "source"}
RECORDED = re.compile(r"(?<![\w:])[a-z_]+:meshscope_[a-z0-9_]+:[a-z0-9_]+")
RAW = re.compile(r"(?<![\w:])meshscope_[a-z0-9_]+")


def groups() -> list[tuple[str, list[dict[str, str]]]]:
    return [(g["name"], g["rules"]) for g in yaml.safe_load(RULES.read_text())["groups"]]


def is_per_rank(record: str) -> bool:
    return record.split(":", maxsplit=1)[0].split("_", maxsplit=1)[0] == "rank"


@pytest.mark.parametrize("rule", [r for r in rules() if is_per_rank(r["record"])], ids=lambda r: r["record"])
def test_a_per_rank_rule_keeps_the_rank_and_reads_counters_only(rule: dict[str, str]) -> None:
    # no aggregation (every label of the rank kept), nothing recorded read, only per-rank metrics of the sidecar
    assert not re.search(r"\b(by|without) \(", rule["expr"]), f"{rule['record']} aggregates"
    assert not RECORDED.findall(rule["expr"]), f"{rule['record']} reads recorded series"
    raw = set(RAW.findall(rule["expr"]))
    assert raw, rule["record"]
    assert all(BY_NAME[m].scope == "rank" for m in raw), f"{rule['record']} reads node-level {raw}"
    # the level names what is kept besides the rank's labels: the metric's own labels (all of them are kept; one
    # that is empty on most series, gpu_instance on a whole GPU, goes unnamed)
    level = set(rule["record"].split(":")[0].split("_")[1:])
    own = {label for m in raw for label in BY_NAME[m].labels}
    assert level <= own, f"{rule['record']}: the level names {level - own}, which the metric does not have"
    assert own - level <= {"gpu_instance"}, f"{rule['record']}: the level does not name {own - level}"


@pytest.mark.parametrize("rule", [r for r in rules() if not is_per_rank(r["record"])], ids=lambda r: r["record"])
def test_an_aggregate_aggregates_rank_away(rule: dict[str, str]) -> None:
    # every `by (...)` keeps only closed-set labels; every selector is aggregated (no bare per-rank output)
    groupings = re.findall(r"\bby \(([^)]*)\)", rule["expr"])
    assert groupings, f"{rule['record']} does not aggregate"
    for g in groupings:
        kept = {s.strip() for s in g.split(",")}
        assert kept <= BOUNDED_LABELS, f"{rule['record']} keeps {kept - BOUNDED_LABELS}"
    level = rule["record"].split(":")[0].split("_")
    outer = {s.strip() for s in groupings[0].split(",")}
    assert set(level) == outer, f"{rule['record']}: the level says {level}, the outer aggregation keeps {outer}"


@pytest.mark.parametrize("group", groups(), ids=lambda g: g[0])
def test_an_aggregate_reads_the_per_rank_level_of_its_own_group(group: tuple[str, list[dict[str, str]]]) -> None:
    # Prometheus evaluates a group's rules in order at one timestamp: a per-rank series recorded earlier in the group
    # is the same evaluation's; one from another group would be a concurrent group's, of no set age. Per-rank
    # counters are never read by an aggregate (that rate() is the per-rank level's, taken once); node-level series
    # (one per sidecar) may be.
    name, group_rules = group
    recorded_so_far: set[str] = set()
    for rule in group_rules:
        record = rule["record"]
        if not is_per_rank(record):
            reads = set(RECORDED.findall(rule["expr"]))
            assert all(is_per_rank(r) for r in reads), f"{record} reads aggregates {reads}"
            assert reads <= recorded_so_far, (
                f"{record} reads {reads - recorded_so_far}, not recorded before it in {name}"
            )
            raw = set(RAW.findall(rule["expr"]))
            assert all(BY_NAME[m].scope == "node" for m in raw), f"{record} reads per-rank counters {raw}"
            assert reads or raw, record
        recorded_so_far.add(record)


def test_the_per_rank_level_is_what_each_group_reads() -> None:
    # no per-rank rule recorded for nothing: every one is read by an aggregate of its group
    for name, group_rules in groups():
        read = {r for rule in group_rules for r in RECORDED.findall(rule["expr"])}
        unread = [r["record"] for r in group_rules if is_per_rank(r["record"]) and r["record"] not in read]
        assert not unread, f"{name}: {unread}"


# ---- the live stores ------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Live:
    prometheus: Service
    victoria: Service


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    work = tmp_path_factory.mktemp("promstack")
    rules_copy = work / "recording-rules.yaml"
    shutil.copy(RULES, rules_copy)
    with contextlib.ExitStack() as stack:
        expositions = stack.enter_context(synthetic_job())
        targets = [e.target for e in expositions]
        prom = stack.enter_context(start_prometheus(work / "prometheus", targets=targets, rule_files=[rules_copy]))
        vm = stack.enter_context(start_victoria_metrics(work / "victoria-metrics", targets=targets))
        stack.enter_context(start_vmalert(work / "vmalert", rule_files=[rules_copy], store_url=vm.url))

        def all_recorded(store: Service) -> bool:
            return all(len(store.query(name)) == len(series) for name, series in EXPECTED.items())

        def scraped_thrice(store: Service) -> bool:
            rows = store.query("count_over_time(up[5m])")
            return len(rows) == len(targets) and min(float(r["value"][1]) for r in rows) >= 3

        def evaluated_after(store: Service, t: float) -> bool:
            for name, series in EXPECTED.items():
                rows = store.query(f"timestamp({name})")
                if len(rows) != len(series) or min(float(r["value"][1]) for r in rows) <= t:
                    return False
            return True

        # Prometheus' discovery hands it the targets after ~5 s; the VictoriaMetrics chain (scrape, vmalert's
        # per-rank level, its aggregates) is flushed while waited for, so waited for first it runs meanwhile. A
        # rule evaluated while one target had a single sample in its window sums the other target's rate alone
        # (a node's rate is absent, not 0): the values are read from evaluations after every target was scraped
        # three times (vmalert's aggregates read the per-rank level through remote write: a few seconds later).
        for store in (vm, prom):
            store.wait_for("series for every rule", lambda s=store: all_recorded(s), timeout_s=30)
            store.wait_for("three scrapes of every target", lambda s=store: scraped_thrice(s))
        ready_at = time.time()
        for store, lag_s in ((vm, 4.0), (prom, 1.0)):
            store.wait_for(
                "every rule evaluated over three scrapes", lambda s=store, t=ready_at + lag_s: evaluated_after(s, t)
            )
        yield Live(prometheus=prom, victoria=vm)


@pytest.mark.parametrize("name", list(EXPECTED))
def test_prometheus_records_the_hand_derived_values(live: Live, name: str) -> None:
    got = settled(live.prometheus, name, len(EXPECTED[name]))
    assert set(got) == set(EXPECTED[name]), f"{name}: label sets {sorted(map(sorted, got))}"
    for labels, want in EXPECTED[name].items():
        check_value(got[labels], want, rel=PROMETHEUS_REL_TOL, what=f"{name}{dict(labels)}")


def test_every_rule_has_hand_derived_values() -> None:
    records = [r["record"] for r in rules()]
    assert len(records) == len(set(records))
    assert set(records) == set(EXPECTED)


def test_the_per_rank_table_adds_up() -> None:
    # the hand derivation itself: each rank's categories add up to its step time; own = step - exposed - bubble
    for r, row in SECONDS_PER_STEP.items():
        assert math.isclose(sum(row), STEP_S[r], rel_tol=1e-12), r
        waiting = sum(v for (c, _a), v in zip(CATEGORIES, row, strict=True) if c in {"exposed_comm", "bubble"})
        assert math.isclose(STEP_S[r] - waiting, OWN_S[r], rel_tol=1e-12), r


def test_shares_add_up_to_one() -> None:
    # the hand derivation itself: the categories of the scenario add up to the step time
    assert math.isclose(sum(JOB_SHARES.values()), 1.0, rel_tol=1e-12)
    for pp in ("0", "1"):
        assert math.isclose(sum(v for (p, _c, _a), v in PP_SHARES.items() if p == pp), 1.0, rel_tol=1e-12)


@pytest.mark.parametrize("rule", rules(), ids=lambda r: r["record"])
def test_victoria_metrics_evaluates_the_expression_like_prometheus(live: Live, rule: dict[str, str]) -> None:
    name = rule["record"]
    prom = settled(live.prometheus, name, len(EXPECTED[name]))
    vm = settled(live.victoria, rule["expr"], len(EXPECTED[name]))
    assert set(vm) == set(prom), (
        f"{name}: VictoriaMetrics {sorted(map(sorted, vm))} vs Prometheus {sorted(map(sorted, prom))}"
    )
    for labels, want in EXPECTED[name].items():
        if name in ABSOLUTE_RATES:
            check_value(vm[labels], want, rel=0, what=f"VictoriaMetrics {name}{dict(labels)}")
        else:
            check_value(vm[labels], prom[labels], rel=VICTORIA_REL_TOL, what=f"VictoriaMetrics {name}{dict(labels)}")


@pytest.mark.parametrize("name", list(EXPECTED))
def test_vmalert_records_the_rules_into_victoria_metrics(live: Live, name: str) -> None:
    prom = settled(live.prometheus, name, len(EXPECTED[name]))
    vm = settled(live.victoria, name, len(EXPECTED[name]))
    assert set(vm) == set(prom), f"{name}: vmalert recorded {sorted(map(sorted, vm))}"
    for labels, want in EXPECTED[name].items():
        if name in ABSOLUTE_RATES:
            check_value(vm[labels], want, rel=0, what=f"vmalert {name}{dict(labels)}")
        else:
            check_value(vm[labels], prom[labels], rel=VICTORIA_REL_TOL, what=f"vmalert {name}{dict(labels)}")


@pytest.mark.parametrize(("name", "package"), [("promtool", "prometheus"), ("vmalert", "victoria-metrics")])
def test_a_missing_binary_fails_and_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch, name: str, package: str
) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(pytest.fail.Exception, match=rf"run `make system-deps`.*Debian's `{package}` package"):
        binary(name)

"""Identity from the pod's environment: ranks and coords of every local GPU, precedence, errors, degraded mode."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import pytest

from meshscope_sidecar.identity import IdentityError, IdentityInputs, IdentityMode, resolve_identity, sanitize

if TYPE_CHECKING:
    from pathlib import Path

BASE = {"MESHSCOPE_JOB": "llm", "MESHSCOPE_NODE_NAME": "gpu-node-17"}


def _resolve(env: dict[str, str]):
    return resolve_identity(IdentityInputs.from_env({**BASE, **env}))


def test_default_placement_gives_consecutive_ranks_and_megatron_coords() -> None:
    # tp=2,pp=2,dp=2 in the order tp-cp-ep-dp-pp: tp stride 1, dp stride 2, pp stride 4; node 1 of 4-GPU nodes
    # holds ranks 4..7, all on pipeline stage 1.
    ident = _resolve({"MESHSCOPE_LAYOUT": "tp=2,pp=2,dp=2", "MESHSCOPE_GPUS_PER_NODE": "4", "MESHSCOPE_NODE_RANK": "1"})
    assert ident.mode is IdentityMode.FULL
    got = [(g.gpu, g.rank, g.coord.tp, g.coord.dp, g.coord.pp) for g in ident.gpus]
    assert got == [(0, 4, 0, 0, 1), (1, 5, 1, 0, 1), (2, 6, 0, 1, 1), (3, 7, 1, 1, 1)]
    assert ident.ranks == frozenset({4, 5, 6, 7})
    assert (ident.job, ident.node, ident.nvlink_domain, ident.network_tier) == ("llm", "gpu-node-17", "", "")


def test_a_rank_order_other_than_the_default_comes_with_the_layout() -> None:
    ident = _resolve(
        {
            "MESHSCOPE_LAYOUT": "tp=2,dp=2,order=dp-tp-cp-ep-pp",
            "MESHSCOPE_GPUS_PER_NODE": "2",
            "MESHSCOPE_NODE_RANK": "0",
        }
    )
    # dp varies fastest: rank 1 is dp=1, tp=0
    assert [(g.rank, g.coord.dp, g.coord.tp) for g in ident.gpus] == [(0, 0, 0), (1, 1, 0)]


@pytest.mark.parametrize(
    ("env", "node_rank"),
    [
        ({"MESHSCOPE_NODE_RANK": "2", "JOB_COMPLETION_INDEX": "1", "PET_NODE_RANK": "0"}, 2),
        ({"JOB_COMPLETION_INDEX": "1", "PET_NODE_RANK": "0"}, 1),
        ({"PET_NODE_RANK": "3"}, 3),
    ],
    ids=["meshscope-first", "completion-index-next", "pet-last"],
)
def test_node_rank_precedence(env: dict[str, str], node_rank: int) -> None:
    ident = _resolve({"MESHSCOPE_LAYOUT": "dp=8", "MESHSCOPE_GPUS_PER_NODE": "2", **env})
    assert [g.rank for g in ident.gpus] == [2 * node_rank, 2 * node_rank + 1]


def test_completion_index_from_the_downward_api_labels_file(tmp_path: Path) -> None:
    labels = tmp_path / "labels"
    labels.write_text(
        'app="trainer"\nbatch.kubernetes.io/job-completion-index="3"\nnote="a \\"quoted\\" value"\ngarbage line\n'
    )
    ident = _resolve(
        {
            "MESHSCOPE_LAYOUT": "dp=8",
            "MESHSCOPE_GPUS_PER_NODE": "2",
            "MESHSCOPE_POD_LABELS_FILE": str(labels),
            "PET_NODE_RANK": "0",
        }
    )
    assert [g.rank for g in ident.gpus] == [6, 7]
    assert any("job-completion-index" in s for s in ident.sources)


@pytest.mark.parametrize("fmt", ["json", "yaml"])
def test_placement_file_names_the_ranks_and_labels_of_this_node(tmp_path: Path, fmt: str) -> None:
    doc = {
        "schema": "meshscope.placement/1",
        "nodes": {
            "gpu-node-3": {"nvlink_domain": "nvl-a.1", "network_tier": "block-0", "ranks": [0, 1, 2, 3]},
            "gpu-node-17": {"nvlink_domain": "nvl-b.1", "network_tier": "block-1", "ranks": [6, None, 4, 5]},
        },
    }
    path = tmp_path / f"placement.{fmt}"
    if fmt == "json":
        path.write_text(json.dumps(doc))
    else:
        import yaml  # noqa: PLC0415

        path.write_text(yaml.safe_dump(doc))
    ident = _resolve(
        {"MESHSCOPE_LAYOUT": "tp=2,dp=4", "MESHSCOPE_PLACEMENT_FILE": str(path), "MESHSCOPE_NETWORK_TIER": "env-tier"}
    )
    assert [(g.gpu, g.rank) for g in ident.gpus] == [(0, 6), (2, 4), (3, 5)]
    assert (ident.nvlink_domain, ident.network_tier) == ("nvl-b.1", "block-1")  # the file beats the environment
    assert ident.by_gpu(1) is None
    assert ident.by_rank(6) is not None
    assert ident.by_rank(6).coord.dp == 3


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"MESHSCOPE_JOB": ""}, "MESHSCOPE_JOB is not set"),
        ({"MESHSCOPE_NODE_NAME": ""}, "MESHSCOPE_NODE_NAME is not set; set it from the downward API"),
        ({"MESHSCOPE_LAYOUT": "tp=2,dp=x"}, "MESHSCOPE_LAYOUT='tp=2,dp=x': layout dp='x' is not a whole number"),
        ({"MESHSCOPE_GPUS_PER_NODE": "eight"}, "MESHSCOPE_GPUS_PER_NODE='eight' is not a whole number >= 1"),
        ({"MESHSCOPE_NODE_RANK": "-1"}, "MESHSCOPE_NODE_RANK='-1' is not a whole number >= 0"),
        ({"MESHSCOPE_NODE_RANK": "4"}, "MESHSCOPE_NODE_RANK=4 is outside the job: 8 ranks at 2 per node make 4 nodes"),
        ({"MESHSCOPE_GPUS_PER_NODE": "3"}, "MESHSCOPE_GPUS_PER_NODE=3 does not divide the layout's world of 8 ranks"),
    ],
    ids=["no-job", "no-node", "bad-layout", "bad-gpus", "negative-node-rank", "node-rank-outside", "gpus-not-dividing"],
)
def test_bad_identity_is_an_error_naming_the_variable_and_value(env: dict[str, str], message: str) -> None:
    full = {"MESHSCOPE_LAYOUT": "tp=2,dp=4", "MESHSCOPE_GPUS_PER_NODE": "2", "MESHSCOPE_NODE_RANK": "0", **env}
    with pytest.raises(IdentityError) as info:
        _resolve(full)
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("nodes", "message"),
    [
        ({"a": {"ranks": [0, 9]}}, "ranks[1] = 9 is outside the layout's world of 8 ranks"),
        ({"a": {"ranks": [0]}, "b": {"ranks": [0]}}, "ranks[0] = 0 is also placed on node 'a'"),
        ({"a": {"ranks": ["0"]}}, "ranks[0] = '0'; expected a global rank >= 0 or null"),
        ({"a": {"ranks": [0], "nvlink_domain": 7}}, "nvlink_domain = 7; expected a string"),
        ({"a": [0, 1]}, "expected an object with a list 'ranks'"),
    ],
    ids=["outside-world", "twice", "string-rank", "number-domain", "not-an-object"],
)
def test_bad_placement_files_are_errors_naming_the_field(tmp_path: Path, nodes: object, message: str) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"schema": "meshscope.placement/1", "nodes": nodes}))
    with pytest.raises(IdentityError) as info:
        _resolve({"MESHSCOPE_LAYOUT": "dp=8", "MESHSCOPE_PLACEMENT_FILE": str(path)})
    assert f"MESHSCOPE_PLACEMENT_FILE='{path}'" in str(info.value)
    assert message in str(info.value)


def test_a_placement_file_that_is_not_one(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_text('{"nodes": {}}')
    with pytest.raises(IdentityError, match=r"expected an object with schema 'meshscope\.placement/1'"):
        _resolve({"MESHSCOPE_PLACEMENT_FILE": str(path)})
    with pytest.raises(IdentityError, match="cannot be read"):
        _resolve({"MESHSCOPE_PLACEMENT_FILE": str(tmp_path / "absent.json")})


@pytest.mark.parametrize(
    ("env", "missing"),
    [
        ({"MESHSCOPE_GPUS_PER_NODE": "2", "MESHSCOPE_NODE_RANK": "0"}, "MESHSCOPE_LAYOUT is not set"),
        ({"MESHSCOPE_LAYOUT": "dp=2", "MESHSCOPE_NODE_RANK": "0"}, "MESHSCOPE_GPUS_PER_NODE is not set"),
        ({"MESHSCOPE_LAYOUT": "dp=2", "MESHSCOPE_GPUS_PER_NODE": "2"}, "no node rank: none of MESHSCOPE_NODE_RANK"),
    ],
    ids=["no-layout", "no-gpus-per-node", "no-node-rank"],
)
def test_missing_rank_information_degrades_and_says_what(env: dict[str, str], missing: str) -> None:
    ident = _resolve(env)
    assert ident.mode is IdentityMode.DEGRADED
    assert ident.gpus == ()
    assert ident.ranks is None
    assert any(missing in m for m in ident.missing)
    assert missing in ident.describe()
    assert (ident.job, ident.node) == ("llm", "gpu-node-17")


def test_a_placement_that_does_not_name_this_node_degrades(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"schema": "meshscope.placement/1", "nodes": {"other": {"ranks": [0, 1]}}}))
    ident = _resolve({"MESHSCOPE_LAYOUT": "dp=2", "MESHSCOPE_PLACEMENT_FILE": str(path)})
    assert ident.mode is IdentityMode.DEGRADED
    assert "does not name node 'gpu-node-17'" in ident.missing[0]


def test_label_values_are_valid_utf8_and_bounded() -> None:
    bad = "node-\udcff-" + "x" * 400
    value = sanitize(bad)
    value.encode("utf-8")  # would raise on a lone surrogate
    assert len(value) == 253
    assert value.startswith("node-?-")
    ident = _resolve({"MESHSCOPE_NODE_NAME": bad, "MESHSCOPE_NVLINK_DOMAIN": "d\nx"})
    assert ident.node == value
    assert ident.nvlink_domain == "d x"

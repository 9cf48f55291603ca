"""kubectl-meshscope without a cluster: the stored table's reader on hostile input (hypothesis), its command line,
and ``plan`` printing what ``meshscope plan`` prints. Through the real kubectl: tests/kube/test_kubectl_e2e.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshscope.analysis import analyze, render_analysis
from meshscope.cli import main as meshscope_main
from meshscope.records import read_table
from meshscope_operator.kubectl_plugin import PluginError, build_parser, cost_table_text, main

ROOT = Path(__file__).resolve().parents[2]
RECORDS = ROOT / "tests" / "data" / "pp2_tp2_dp2_straggler" / "records.jsonl"
ANALYSIS = analyze(read_table([RECORDS]))
STORED = ANALYSIS.to_dict()

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=12,
)


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _paths(value, (*prefix, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _paths(value, (*prefix, i))


PATHS = [p for p in _paths(STORED) if p]


def _replace(data, path, value):
    out = json.loads(json.dumps(data))
    node = out
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return out


def _outcome(raw: str) -> tuple[str, str | None]:
    """The text, or the refusal's message (any other exception fails the test)."""
    try:
        return cost_table_text(raw, where="ConfigMap ns/x"), None
    except PluginError as exc:
        return "", str(exc)


def test_a_stored_table_prints_as_meshscope_analyze_prints_it() -> None:
    assert cost_table_text(json.dumps(STORED), where="cm") == render_analysis(ANALYSIS)
    assert json.loads(cost_table_text(json.dumps(STORED), where="cm", as_json=True)) == STORED


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(path=st.sampled_from(PATHS), value=json_values)
def test_a_damaged_table_is_printed_or_refused_in_one_line(path, value) -> None:
    raw = json.dumps(_replace(STORED, path, value))
    text, refused = _outcome(raw)
    if refused is None:
        assert text.startswith("meshscope analyze: job ")
    else:
        assert refused.startswith("ConfigMap ns/x: data key 'analysis.json' is not a meshscope cost table (")


@settings(max_examples=100, deadline=None)
@given(raw=st.one_of(st.text(max_size=40), json_values.map(json.dumps)))
def test_anything_else_is_refused_in_one_line(raw) -> None:
    text, refused = _outcome(raw)
    assert refused is not None or text.startswith("meshscope analyze: job ")
    assert refused is None or "is not a meshscope cost table" in refused


def test_plan_prints_what_meshscope_plan_prints(capsys) -> None:
    assert meshscope_main(["plan", str(ROOT / "examples" / "bad-tp16-h100.yaml")]) == 0
    expected = capsys.readouterr().out
    assert main(["plan", str(ROOT / "examples" / "bad-tp16-h100.yaml")]) == 0
    assert capsys.readouterr().out == expected


def test_a_file_that_does_not_load_exits_2_with_one_line(capsys) -> None:
    assert main(["plan", "no-such.yaml"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kubectl meshscope: error: ")
    assert err.count("\n") == 1


@pytest.mark.parametrize(
    ("argv", "start"),
    [
        (["cost"], "kubectl meshscope: error: the following arguments are required: name"),
        (["bogus"], "kubectl meshscope: error: argument command: invalid choice: 'bogus'"),
    ],
    ids=["no-name", "unknown-command"],
)
def test_bad_command_lines_exit_2_with_one_line(argv, start, capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(start), err
    assert err.count("\n") == 1


PLUGIN_SURFACE = {
    "plan": ["-h", "--help"],
    "cost": ["--context", "--json", "--kubeconfig", "-n", "--namespace", "-h", "--help"],
}


def test_the_plugins_command_line_is_frozen() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    surface = {name: sorted(o for a in p._actions for o in a.option_strings) for name, p in sub.choices.items()}
    assert surface == {name: sorted(opts) for name, opts in PLUGIN_SURFACE.items()}


def test_the_plugin_needs_neither_kopf_nor_a_kubernetes_client() -> None:
    code = (
        "import sys, meshscope_operator.kubectl_plugin; "
        "print(sorted(m for m in ('kopf', 'kubernetes', 'aiohttp') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout == "[]\n"

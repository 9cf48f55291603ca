"""docs/metrics.md is generated from the metric list (meshscope_sidecar.metrics) and the recording rules, and
matches; every metric name the rules and the dashboard use is in the list; every recorded series the dashboard
uses is a rule of the file.
"""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from meshscope_sidecar.metrics import (
    BY_NAME,
    METRICS,
    MetricType,
    RulesFileError,
    read_recording_rules,
    render_markdown,
)

ROOT = Path(__file__).resolve().parents[2]
RULES_PATH = "sidecar/monitoring/recording-rules.yaml"
RULES = ROOT / RULES_PATH
DASHBOARD = ROOT / "sidecar" / "monitoring" / "dashboard.json"
DOC = ROOT / "docs" / "metrics.md"
REGENERATE = f"`.venv/bin/python -m meshscope_sidecar.metrics {RULES_PATH} > docs/metrics.md`"

METRIC_NAME = re.compile(r"(?<![\w:])meshscope_[a-z0-9_]+")
RECORD_NAME = re.compile(r"(?<![\w:])[a-z_]+:meshscope_[a-z0-9_]+:[a-z0-9_]+")


def rule_exprs() -> list[str]:
    return [r["expr"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def dashboard_exprs() -> list[str]:
    doc = json.loads(DASHBOARD.read_text())
    exprs = [v["query"]["query"] for v in doc["templating"]["list"] if v["type"] == "query"]
    for p in doc["panels"]:
        for q in [p, *p.get("panels", [])]:
            exprs += [t["expr"] for t in q.get("targets", [])]
    return exprs


def test_the_page_matches_the_generator() -> None:
    expected = render_markdown(read_recording_rules(RULES.read_text()), rules_path=RULES_PATH)
    assert DOC.read_text() == expected, f"docs/metrics.md is stale: regenerate it with {REGENERATE}"


def test_the_page_lists_every_metric_and_every_rule_once() -> None:
    page = DOC.read_text()
    for m in METRICS:
        row = re.findall(rf"^\| `{m.name}` \| {m.type} \| {re.escape(m.unit)} \|.*$", page, flags=re.MULTILINE)
        assert len(row) == 1, f"{m.name}: {row}"
        assert m.help.split(" (")[0] in row[0]
    records = [r["record"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    for record in records:
        assert len(re.findall(rf"^\| `{re.escape(record)}` \|", page, flags=re.MULTILINE)) == 1, record


@pytest.mark.parametrize(("where", "exprs"), [("rules", rule_exprs()), ("dashboard", dashboard_exprs())])
def test_every_metric_name_used_exists(where: str, exprs: list[str]) -> None:
    used = {name for e in exprs for name in METRIC_NAME.findall(e)}
    assert used, f"no metric names found in the {where}"
    assert not used - BY_NAME.keys(), f"the {where} use metrics that METRICS does not list: {used - BY_NAME.keys()}"


def test_every_recorded_series_the_dashboard_uses_is_a_rule() -> None:
    records = {r["record"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]}
    used = {name for e in dashboard_exprs() for name in RECORD_NAME.findall(e)}
    assert used
    assert not used - records, f"the dashboard uses series no rule records: {used - records}"


def test_the_name_finders_see_what_they_must() -> None:
    # the two regular expressions the checks above rest on: raw names inside rule names are not raw names
    expr = 'job_pp:meshscope_step_seconds:max_rate5m{job="x"} / rate(meshscope_steps_total[5m])'
    assert METRIC_NAME.findall(expr) == ["meshscope_steps_total"]
    assert RECORD_NAME.findall(expr) == ["job_pp:meshscope_step_seconds:max_rate5m"]


def test_counters_and_only_counters_end_in_total() -> None:
    for m in METRICS:
        assert m.name.startswith("meshscope_"), m.name
        assert m.name.endswith("_total") == (m.type is MetricType.COUNTER), m.name


def test_a_rule_without_a_meaning_is_refused() -> None:
    text = "groups:\n  - name: g\n    rules:\n      # means something\n      - record: a:b:c\n        expr: up\n      - record: d:e:f\n        expr: up\n"
    with pytest.raises(RulesFileError, match="d:e:f has no comment"):
        read_recording_rules(text)


def test_a_rule_meaning_is_the_comment_just_above_it() -> None:
    text = (
        "# header, not a meaning\ngroups:\n  - name: g\n    rules:\n"
        "      # first line\n      # second line\n      - record: a:b:c\n        expr: up\n"
        "      # other\n      - record: d:e:f\n        expr: sum(up)\n"
    )
    rules = read_recording_rules(text)
    assert [(r.group, r.record, r.meaning, r.expr) for r in rules] == [
        ("g", "a:b:c", "first line second line", "up"),
        ("g", "d:e:f", "other", "sum(up)"),
    ]
    assert rules[0].kept_labels == ("a",)


def test_not_a_rule_file_is_refused() -> None:
    with pytest.raises(RulesFileError, match="no top-level 'groups'"):
        read_recording_rules("rule_files: []\n")


# ---- fuzzing the rules-file reader from the grammar: groups of recording (and alerting) rules, each recording rule
# ---- under one or more comment lines, record names plain or quoted, expressions as block scalars

COMMENT_TEXT = st.text(
    st.characters(min_codepoint=0x20, max_codepoint=0xD7FF, blacklist_categories=("Cc", "Cs", "Zl", "Zp")),
    max_size=40,
)
RECORD = st.from_regex(r"[a-z]{1,6}(_[a-z]{1,6}){0,2}:meshscope_[a-z0-9_]{1,12}:[a-z0-9_]{1,12}", fullmatch=True)
EXPR = st.lists(
    st.sampled_from(["sum by (job) (", "rate(meshscope_steps_total[5m])", ")", " / ", "max(up)", "# not a comment"]),
    min_size=1,
    max_size=6,
).map(lambda parts: "".join(parts).strip())


@st.composite
def rule_files(draw: st.DrawFn) -> tuple[str, list[tuple[str, str, str, str]]]:
    """A rule file's text and the (group, record, meaning, expr) it holds, in order."""
    lines = ["# a header comment, not a meaning", "groups:"]
    expected = []
    records = draw(st.lists(RECORD, min_size=1, max_size=8, unique=True))
    cuts = sorted(draw(st.sets(st.integers(1, len(records) - 1), max_size=2))) if len(records) > 1 else []
    for g, (start, end) in enumerate(zip([0, *cuts], [*cuts, len(records)], strict=True)):
        lines += [f"  - name: group-{g}", "    rules:"]
        for record in records[start:end]:
            if draw(st.booleans()):
                lines += ["      - alert: Something", "        expr: up == 0"]
            if draw(st.booleans()):
                lines.append("")  # a blank line before the comment does not matter
            comment = draw(st.lists(COMMENT_TEXT, min_size=1, max_size=3).filter(lambda c: any(x.strip() for x in c)))
            lines += [f"      # {c}".rstrip() for c in comment]
            quote = draw(st.sampled_from(["", '"', "'"]))
            expr = draw(EXPR)
            lines += [f"      - record: {quote}{record}{quote}", "        expr: |", f"          {expr}"]
            meaning = " ".join(c.strip() for c in comment)
            expected.append((f"group-{g}", record, meaning, expr + "\n"))
    return "\n".join(lines) + "\n", expected


@settings(deadline=None)  # no wall-clock bound: the machine is shared
@given(rule_files())
def test_rule_files_read_back_what_they_hold(case: tuple[str, list[tuple[str, str, str, str]]]) -> None:
    text, expected = case
    got = [(r.group, r.record, r.meaning, r.expr) for r in read_recording_rules(text)]
    assert got == expected


@settings(deadline=None)
@given(rule_files(), st.data())
def test_a_rule_whose_comment_is_gone_is_named(
    case: tuple[str, list[tuple[str, str, str, str]]], data: st.DataObject
) -> None:
    text, expected = case
    _group, record, _meaning, _expr = data.draw(st.sampled_from(expected))
    lines = text.split("\n")
    at = next(
        i for i, line in enumerate(lines) if line.strip().strip("- ").removeprefix("record: ").strip("\"'") == record
    )
    while lines[at - 1].lstrip().startswith("#"):
        del lines[at - 1]
        at -= 1
    with pytest.raises(RulesFileError, match=re.escape(record)):
        read_recording_rules("\n".join(lines))


@settings(deadline=None)
@given(
    st.one_of(
        st.text(max_size=300),
        rule_files().map(lambda c: c[0]).flatmap(lambda t: st.integers(0, len(t)).map(lambda n: t[:n])),
    )
)
def test_garbage_and_truncated_files_are_refused_cleanly(text: str) -> None:
    # any text: read, or refused with RulesFileError; never another exception
    with contextlib.suppress(RulesFileError):
        read_recording_rules(text)


def test_a_hash_line_inside_an_expression_is_not_the_next_rules_meaning() -> None:
    text = (
        "groups:\n  - name: g\n    rules:\n      # first\n      - record: a:b:c\n        expr: |\n          up\n"
        "          # inside the block scalar\n      # second\n      - record: d:e:f\n        expr: up\n"
    )
    assert [r.meaning for r in read_recording_rules(text)] == ["first", "second"]

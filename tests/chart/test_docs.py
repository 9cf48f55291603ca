"""The chart's README cannot drift from values.yaml, and docs/operator.md points at the chart."""

from __future__ import annotations

import yaml

from charting import CHART, ROOT, documented_values, readme_with_values_table


def test_the_readmes_values_table_is_generated_from_values_yaml() -> None:
    readme = (CHART / "README.md").read_text()
    assert readme == readme_with_values_table(readme), "run `.venv/bin/python tests/charting.py` to regenerate it"


def test_every_value_in_values_yaml_is_documented() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    documented = {v.path for v in documented_values()}

    def leaves(node: object, path: str = "") -> set[str]:
        if isinstance(node, dict) and node:
            return {leaf for key, child in node.items() for leaf in leaves(child, f"{path}.{key}" if path else key)}
        return {path}

    def covered(path: str) -> bool:
        parts = path.split(".")
        return any(".".join(parts[:i]) in documented for i in range(1, len(parts) + 1))

    assert {leaf for leaf in leaves(values) if not covered(leaf)} == set()


def test_the_doc_comment_parser_reads_paths_defaults_and_continuations() -> None:
    text = "a:\n  # -- first line\n  # second line\n  b: 1\n  c:\n    # -- deep\n    d: [x]\n# -- top\ne: {}\n"
    parsed = [(v.path, v.default, v.description) for v in documented_values(text)]
    assert parsed == [("a.b", 1, "first line second line"), ("a.c.d", ["x"], "deep"), ("e", {}, "top")]


def test_operator_docs_tell_how_to_install_with_helm() -> None:
    docs = (ROOT / "docs" / "operator.md").read_text()
    section = docs.split("## Install with Helm", 1)[1].split("\n## ", 1)[0]
    assert "helm install" in section
    assert "charts/meshscope/README.md" in section

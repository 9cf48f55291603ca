"""``kubectl-meshscope``: the kubectl plugin (``kubectl meshscope plan FILE``, ``kubectl meshscope cost NAME``).

kubectl runs any ``kubectl-*`` program on ``PATH`` as a subcommand. This one prints, for a TrainingJob in the
cluster, the full cost table the operator's deep tier keeps in a ConfigMap, with exactly the text ``meshscope
analyze`` prints (:func:`meshscope.analysis.render_analysis_dict`), and plans a TrainingJob file with exactly the
text of ``meshscope plan FILE`` (:func:`meshscope.plan.render_plan_report`).

It reads the cluster through ``kubectl`` itself (the binary that called it, ``$KUBECTL_PLUGINS_CALLER``, else
``kubectl`` on ``PATH``), so every kubeconfig, context and credential plugin works as it does for kubectl, and
``--kubeconfig``, ``--context`` and ``-n/--namespace`` mean what they mean there. Every call has a timeout.

The ConfigMap contract (docs/operator.md, "kubectl"): ``status.costTableRef`` of the TrainingJob names a ConfigMap
in the job's namespace whose ``data[COST_TABLE_KEY]`` holds ``Analysis.to_dict()`` as JSON (docs/cost-table.md).

Errors are one line on stderr, ``kubectl meshscope: error: ...``: exit 1 for what the cluster holds (no such job,
no ``costTableRef`` yet, a missing or unreadable ConfigMap, kubectl failing), 2 for a bad command line or file.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import TYPE_CHECKING, Any

from meshscope.analysis import render_analysis_dict
from meshscope.errors import MeshscopeError
from meshscope.jobs import load_spec
from meshscope.plan import plan_job, render_plan_report

if TYPE_CHECKING:
    from collections.abc import Sequence

COST_TABLE_KEY = "analysis.json"
"""The key of the cost-table ConfigMap's ``data`` holding ``Analysis.to_dict()`` as JSON."""
KUBECTL_TIMEOUT_S = 30.0
"""Longest a kubectl call may take (``--request-timeout`` is set a little below it)."""
EXIT_OK, EXIT_CLUSTER, EXIT_USAGE = 0, 1, 2
PROG = "kubectl meshscope"


class PluginError(Exception):
    """A one-line error and the exit status it ends the plugin with."""

    def __init__(self, message: str, code: int = EXIT_CLUSTER) -> None:
        """``message`` is printed after ``kubectl meshscope: error:``; ``code`` is the exit status."""
        super().__init__(message)
        self.code = code


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USAGE, f"{PROG}: error: {message} (see '{PROG} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    """The plugin's whole command line (frozen by tests/operator/test_kubectl_plugin.py)."""
    parser = _Parser(prog=PROG, description="meshscope for TrainingJobs in a cluster (docs/operator.md, kubectl).")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    plan = sub.add_parser("plan", help="plan a TrainingJob file, as `meshscope plan FILE` prints it")
    plan.add_argument("file", help="TrainingJob manifest (YAML)")
    cost = sub.add_parser("cost", help="the full cost table of a TrainingJob, as `meshscope analyze` prints it")
    cost.add_argument("name", help="the TrainingJob's name")
    cost.add_argument("-n", "--namespace", help="its namespace (default: the kubeconfig context's)")
    cost.add_argument("--kubeconfig", help="kubeconfig file (default: kubectl's)")
    cost.add_argument("--context", help="kubeconfig context (default: the current one)")
    cost.add_argument("--json", action="store_true", help="print the stored Analysis JSON instead of the table")
    return parser


def _kubectl(args: argparse.Namespace, *words: str) -> tuple[int, str, str]:
    """Run kubectl with the user's connection flags; its exit status, stdout and stderr."""
    command = [os.environ.get("KUBECTL_PLUGINS_CALLER") or "kubectl"]
    if args.kubeconfig:
        command += ["--kubeconfig", args.kubeconfig]
    if args.context:
        command += ["--context", args.context]
    if args.namespace:
        command += ["--namespace", args.namespace]
    command += [f"--request-timeout={int(KUBECTL_TIMEOUT_S) - 5}s", *words]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=KUBECTL_TIMEOUT_S, check=False)  # noqa: S603 - kubectl, with our own arguments
    except FileNotFoundError as exc:
        raise PluginError(f"cannot run {command[0]!r}: {exc.strerror}") from exc
    except subprocess.TimeoutExpired as exc:
        raise PluginError(f"kubectl did not answer within {KUBECTL_TIMEOUT_S:g} s: {' '.join(words)}") from exc
    return done.returncode, done.stdout, done.stderr


def _get(args: argparse.Namespace, kind: str, name: str) -> dict[str, Any] | None:
    """The object as kubectl gets it; ``None`` if the API server says it does not exist."""
    code, out, err = _kubectl(args, "get", kind, name, "-o", "json")
    if code != 0:
        if "NotFound" in err or "not found" in err:
            return None
        first = next((line for line in err.splitlines() if line.strip()), f"exit status {code}")
        raise PluginError(f"kubectl get {kind} {name} failed: {first.strip()}")
    try:
        obj = json.loads(out)
    except ValueError as exc:
        raise PluginError(f"kubectl get {kind} {name} printed no JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise PluginError(f"kubectl get {kind} {name} printed no object")
    return obj


def cost_text(args: argparse.Namespace) -> str:
    """The ``cost`` subcommand's output.

    Raises:
        PluginError: no such TrainingJob, no ``status.costTableRef`` yet, a missing or unreadable ConfigMap.
    """
    job = _get(args, "trainingjobs.meshscope.io", args.name)
    where = f" in namespace {args.namespace!r}" if args.namespace else ""
    if job is None:
        raise PluginError(f"no TrainingJob {args.name!r}{where}")
    namespace = (job.get("metadata") or {}).get("namespace", args.namespace or "")
    status = job.get("status")
    ref = status.get("costTableRef") if isinstance(status, dict) else None
    if not isinstance(ref, str) or not ref:
        raise PluginError(
            f"TrainingJob {namespace}/{args.name} has no status.costTableRef yet: the operator's deep tier has not "
            "run for it (it runs every few minutes once the job's sidecars report steps, and on demand; "
            "docs/operator.md)"
        )
    args.namespace = namespace
    config_map = _get(args, "configmap", ref)
    named = f"ConfigMap {namespace}/{ref} (status.costTableRef of TrainingJob {args.name})"
    if config_map is None:
        raise PluginError(f"{named} not found")
    data = config_map.get("data")
    raw = data.get(COST_TABLE_KEY) if isinstance(data, dict) else None
    if not isinstance(raw, str):
        raise PluginError(f"{named} has no data key {COST_TABLE_KEY!r}")
    return cost_table_text(raw, where=named, as_json=args.json)


def cost_table_text(raw: str, *, where: str, as_json: bool = False) -> str:
    """The cost table stored as ``raw`` (the ConfigMap's JSON), as ``meshscope analyze`` prints it.

    Args:
        raw: ``data[COST_TABLE_KEY]``.
        where: names the ConfigMap in the error message.
        as_json: give the JSON back, indented, instead of the table.

    Raises:
        PluginError: whatever ``raw`` holds that is not an ``Analysis.to_dict()``.
    """
    try:
        data = json.loads(raw)
        if as_json:
            return json.dumps(data, indent=2)
        return render_analysis_dict(data)
    except (ValueError, KeyError, TypeError, AttributeError, IndexError, OverflowError) as exc:
        detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        raise PluginError(f"{where}: data key {COST_TABLE_KEY!r} is not a meshscope cost table ({detail})") from exc


def _one_line(exc: Exception, limit: int = 2000) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``kubectl-meshscope``; returns the exit status."""
    args = build_parser().parse_args(sys.argv[1:] if argv is None else list(argv))
    try:
        if args.command == "plan":
            spec = load_spec(args.file)
            text = render_plan_report(spec, plan_job(spec))
        else:
            text = cost_text(args)
    except MeshscopeError as exc:
        sys.stderr.write(f"{PROG}: error: {_one_line(exc)}\n")
        return EXIT_USAGE
    except PluginError as exc:
        sys.stderr.write(f"{PROG}: error: {_one_line(exc)}\n")
        return exc.code
    sys.stdout.write(text + "\n")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())

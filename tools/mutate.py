"""Mutation testing of the core's critical modules with mutmut: ``make mutate`` (docs/testing.md).

Each module group is mutated in a staging copy of the project of its own, ``.mutate/<group>/`` (git-ignored), with
only the tests that exercise it, under a time budget. mutmut keeps its results there, so a run that hit the budget
goes on where it stopped the next time, and a changed function is mutated again. The staging copy leaves out the
dangling symlinks of the sysfs fixtures (tests/data/sidecar), which mutmut's copy cannot follow; none of the tests
run here reads them.

The score is killed ÷ (mutants − those judged equivalent − those not yet checked): a mutant the tests did not
run ("no tests") or that survived counts against it; a timeout counts as killed (the tests noticed). Mutants judged
equivalent (the mutation cannot change any result) are listed, with why, in tools/equivalent-mutants.txt.

    python tools/mutate.py [GROUP ...] [--budget-seconds 600] [--children 2] [--survivors] [--retest]

``--budget-seconds 0`` runs nothing and reports the group's last results (e.g. after a run stopped by hand).

mutmut keeps a verdict until the mutated function changes: a test added since does not re-check the mutants it was
written for. ``--retest`` names the group's surviving and untested mutants to ``mutmut run`` explicitly, which checks
them again with the tests as they are now (new tests are traced first, so mutmut knows which mutants they reach).

Not part of ``make test`` (too slow for CI): it runs before an issue that touches these modules is closed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
STAGING = ROOT / ".mutate"
EQUIVALENT = ROOT / "tools" / "equivalent-mutants.txt"
ALSO_COPY = ("examples", "crds")
"""Folders the tests read besides their own (the example manifests, the CRD), copied beside them for mutmut."""


@dataclass(frozen=True)
class Group:
    """Modules mutated together, and the tests that exercise them."""

    sources: tuple[str, ...]
    tests: tuple[str, ...]


GROUPS: dict[str, Group] = {
    "topology": Group(
        ("src/meshscope/topology/*",),
        ("tests/core/test_layout.py", "tests/core/test_placement.py", "tests/core/test_models_hardware.py"),
    ),
    "records": Group(
        ("src/meshscope/records/*",),
        ("tests/core/test_records.py", "tests/core/test_loading.py", "tests/core/test_fixtures.py"),
    ),
    "breakdown": Group(
        (
            "src/meshscope/analysis/breakdown.py",
            "src/meshscope/analysis/chains.py",
            "src/meshscope/analysis/collectives.py",
        ),
        ("tests/core/test_breakdown.py", "tests/core/test_chains.py", "tests/core/test_collectives.py"),
    ),
    "costs": Group(("src/meshscope/analysis/costs.py",), ("tests/core/test_costs.py", "tests/core/test_breakdown.py")),
    "diagnosis": Group(("src/meshscope/analysis/diagnosis.py",), ("tests/core/test_diagnosis.py",)),
    "plan": Group(
        ("src/meshscope/plan/*",),
        (
            *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests/core").glob("test_plan_*.py")),
            "tests/cli/test_cli_plan.py",  # the rendering and the layout search, as `meshscope plan` prints them
            "tests/core/test_contention.py",  # the CPU contention model of plan/timing.py, derived by hand
        ),
    ),
}

DETECTED = {"killed", "timeout", "caught by type check", "segfault"}
UNCHECKED = {"not checked", "skipped"}


def _stage(name: str, group: Group) -> Path:
    """``.mutate/NAME``: the sources, the tests and pyproject.toml as they are now, and mutmut's setup.cfg."""
    where = STAGING / name
    where.mkdir(parents=True, exist_ok=True)
    for part in ("src", "tests", *ALSO_COPY):
        shutil.copytree(ROOT / part, where / part, symlinks=True, dirs_exist_ok=True)
    shutil.copy2(ROOT / "pyproject.toml", where / "pyproject.toml")
    for link in (where / "tests").rglob("*"):
        if link.is_symlink() and not link.exists():
            link.unlink()

    def listed(key: str, values: tuple[str, ...]) -> str:  # a list in mutmut's setup.cfg: one value per line
        return f"{key}=\n" + "".join(f"    {v}\n" for v in values)

    (where / "setup.cfg").write_text(
        "[mutmut]\n"
        + listed("source_paths", ("src",))
        + listed("only_mutate", group.sources)
        + listed("also_copy", ALSO_COPY)
        + listed("pytest_add_cli_args_test_selection", group.tests)
        + listed("pytest_add_cli_args", ("-q", "-p", "no:cacheprovider"))
    )
    return where


def _mutmut() -> str:
    found = shutil.which("mutmut", path=str(Path(sys.executable).parent))
    if found is None:
        sys.exit("mutate: mutmut is not installed in this interpreter's environment: run `make venv` (dev extra)")
    return found


def _results(where: Path) -> dict[str, str]:
    """Every mutant's status, from ``mutmut results --all true``."""
    done = subprocess.run(
        [_mutmut(), "results", "--all", "true"], cwd=where, capture_output=True, text=True, check=False
    )
    out = {}
    for line in done.stdout.splitlines():
        name, sep, status = line.strip().rpartition(": ")
        if sep and name:
            out[name] = status.strip()
    return out


def _equivalent() -> dict[str, str]:
    """Mutant name -> why it is equivalent, from tools/equivalent-mutants.txt (``name  # reason`` lines)."""
    if not EQUIVALENT.exists():
        return {}
    out = {}
    for line in EQUIVALENT.read_text().splitlines():
        name, _, why = line.partition("#")
        if name.strip():
            out[name.strip()] = why.strip()
    return out


def run_group(name: str, *, budget_s: float, children: int, retest: bool = False) -> dict[str, Any]:
    """Mutate one group within ``budget_s``; its counts and score.

    With ``retest``, the mutants that survived or had no test last time (and are not listed as equivalent) are
    checked again (see the module's doc). With ``budget_s`` 0, nothing runs: the last results are reported.
    """
    where = _stage(name, GROUPS[name])
    judged = _equivalent()  # listed as equivalent: not worth a rerun
    again = (
        sorted(m for m, s in _results(where).items() if s in {"survived", "no tests"} and m not in judged)
        if retest
        else []
    )
    started = time.monotonic()
    finished = False
    if budget_s > 0:  # else: report the last results only
        try:
            subprocess.run(
                [_mutmut(), "run", "--max-children", str(children), *again],
                cwd=where,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                timeout=budget_s,
                check=False,
                env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
            )
            finished = True
        except subprocess.TimeoutExpired:
            finished = False
    status = _results(where)
    equivalent = _equivalent()
    counts: dict[str, int] = {}
    for mutant, state in status.items():
        key = "equivalent" if mutant in equivalent and state not in DETECTED else state
        counts[key] = counts.get(key, 0) + 1
    detected = sum(counts.get(s, 0) for s in DETECTED)
    unchecked = sum(counts.get(s, 0) for s in UNCHECKED)
    scored = len(status) - counts.get("equivalent", 0) - unchecked
    return {
        "group": name,
        "mutants": len(status),
        "counts": counts,
        "score": detected / scored if scored else None,
        "finished": finished,
        "seconds": round(time.monotonic() - started, 1),
        "survivors": sorted(m for m, s in status.items() if s in {"survived", "no tests"} and m not in equivalent),
    }


def main() -> None:
    """``python tools/mutate.py [GROUP ...] [--budget-seconds S] [--children N] [--survivors]``."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("groups", nargs="*", choices=[*GROUPS, []], help="groups to mutate (default: all)")
    p.add_argument(
        "--budget-seconds", type=float, default=600.0, help="per group (default 600; 0: report the last results only)"
    )
    p.add_argument("--children", type=int, default=os.cpu_count() or 1, help="parallel mutants (default: cores)")
    p.add_argument("--survivors", action="store_true", help="list every surviving mutant (see: mutmut show NAME)")
    p.add_argument("--retest", action="store_true", help="check last time's survivors again with today's tests")
    args = p.parse_args()
    rows = []
    for name in args.groups or list(GROUPS):
        row = run_group(name, budget_s=args.budget_seconds, children=args.children, retest=args.retest)
        rows.append(row)
        score = "-" if row["score"] is None else f"{row['score']:.1%}"
        more = (
            " (last results, nothing run)"
            if args.budget_seconds <= 0
            else ("" if row["finished"] else " (budget reached: run again to go on)")
        )
        print(f"{name:10s} {row['mutants']:5d} mutants  score {score:>6s}  {row['counts']}  {row['seconds']} s{more}")
        if args.survivors:
            for mutant in row["survivors"]:
                print(f"    {mutant}   (cd {STAGING / name} && mutmut show {mutant})")
    (STAGING / "scores.json").write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()

"""The TrainingJob review as a pure function: warnings' bounds, and what it does not look at."""

from __future__ import annotations

import copy

from meshscope.plan import Finding, Severity
from meshscope_operator.reviews import admission_warnings, review_training_job, warning_text
from operator_serving import load_example


def _finding(code: str, message: str, severity: Severity = Severity.WARNING) -> Finding:
    return Finding(code=code, severity=severity, message=message)


def test_short_findings_are_passed_on_whole_and_errors_say_so() -> None:
    findings = [_finding("memory-exceeds-hbm", "81 GiB > 80 GiB", Severity.ERROR), _finding("bubble-large", "25%")]
    assert admission_warnings(findings, limit=10) == (
        "memory-exceeds-hbm (error): 81 GiB > 80 GiB",
        "bubble-large: 25%",
    )


def test_a_long_finding_is_cut_to_256_characters_and_the_last_line_says_so() -> None:
    message = "x" * 300
    (cut, summary) = admission_warnings([_finding("c", message)], limit=10)
    assert len(cut) == 256
    assert cut == "c: " + "x" * 252 + "…"
    assert (
        summary
        == "meshscope: 1 findings in all (1 cut short); `meshscope plan` on this manifest prints every one in full"
    )


def test_findings_beyond_the_limit_are_counted_not_shown() -> None:
    findings = [_finding(f"f{i}", "m") for i in range(20)]
    warnings = admission_warnings(findings, limit=15)
    assert warnings[:15] == tuple(f"f{i}: m" for i in range(15))
    assert warnings[15] == (
        "meshscope: 20 findings in all (5 more not shown); `meshscope plan` on this manifest prints every one in full"
    )
    # 15 of at most 256 characters and the summary stay under the API server's 4,096 (warning.go)
    long = [_finding(f"f{i}", "m" * 400) for i in range(20)]
    assert sum(len(w) for w in admission_warnings(long, limit=15)) <= 4096


def test_control_characters_become_spaces() -> None:
    assert warning_text("a\nb\tc\x1bd\x7fe\x85f") == "a b c d e f"
    assert admission_warnings([_finding("c", "two\nlines")], limit=1) == ("c: two lines",)


def test_a_status_only_update_is_not_reviewed() -> None:
    job = load_example("llama3-70b-h100")
    job["spec"]["parallelism"]["tp"] = 3  # would be denied on create
    updated = copy.deepcopy(job)
    updated["status"] = {"phase": "Running"}
    assert review_training_job(updated, job, max_warnings=10, max_planned_gpus=1 << 18).allowed
    assert not review_training_job(updated, None, max_warnings=10, max_planned_gpus=1 << 18).allowed


def test_the_planning_bound_is_inclusive() -> None:
    job = load_example("llama3-70b-h100")  # 512 GPUs, one pp-over-network finding
    at = review_training_job(job, max_warnings=10, max_planned_gpus=512)
    assert at.warnings[0].startswith("pp-over-network: ")
    over = review_training_job(job, max_warnings=10, max_planned_gpus=511)
    assert over.warnings[0].startswith(
        "meshscope: not planned on admission: 512 GPUs is above this operator's bound of 511"
    )

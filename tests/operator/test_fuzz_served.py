"""A fuzzed TrainingJob suite through the served validating webhook, generated from the CRD's own schema.

The generator walks ``crds/trainingjobs.meshscope.io.yaml``'s ``openAPIV3Schema`` (types, ranges, enums, patterns,
``maxItems``, required keys), so what it makes is what the API server would let through to the webhook. Most
examples start from one of the examples and re-draw one to three fields anywhere in the spec from their schema, so
they reach the loader's arithmetic and the planner rather than stopping at the first check; some are whole specs
drawn from the schema; a minority are corrupted in one place (a wrong type, a value out of range, an unknown key), as
a webhook must survive what the schema would have refused.

Properties: the server always answers 200 with a review of the same uid, never a 500 or a traceback; a denial is
422 with exactly the core's message (``SpecError`` / ``PlanError``); an admission has bounded warnings (at most
``max_warnings + 1``, each at most 256 characters without control characters, under 4,096 in all).
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings

from meshscope.errors import MeshscopeError
from meshscope.plan import plan_job
from meshscope_operator.spec import job_spec
from operator_serving import BESIDE_THE_OPERATOR
from trainingjob_strategies import training_jobs


def _core_verdict(job: dict[str, Any], bound: int) -> str | None:
    """The core's own error message for ``job`` (loader, then planner within the bound); ``None`` if none."""
    try:
        spec = job_spec(job)
        if spec.world_size <= bound:
            plan_job(spec)
    except MeshscopeError as exc:
        return str(exc)
    return None


@BESIDE_THE_OPERATOR
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(job=training_jobs())
def test_fuzzed_training_jobs_get_a_clear_verdict(served, job: dict[str, Any]) -> None:
    response = served.review_job(job)  # asserts 200 and the uid
    expected = _core_verdict(job, served.settings.max_planned_gpus)
    if expected is not None:
        assert response["allowed"] is False, (job, response)
        assert response["status"]["code"] == 422, response
        message = response["status"]["message"]
        assert message == (expected if len(expected) <= 4096 else expected[:4095] + "…")
        assert "Traceback" not in message
        assert "warnings" not in response
        return
    assert response["allowed"] is True, (job, response)
    assert "status" not in response
    warnings = response.get("warnings", [])
    assert len(warnings) <= served.settings.max_warnings + 1
    assert sum(len(w) for w in warnings) <= 4096
    for w in warnings:
        assert 0 < len(w) <= 256
        assert not any(ord(c) < 32 or 127 <= ord(c) < 160 for c in w), w


def test_the_generator_reaches_the_deep_checks() -> None:
    """Most drawn jobs load (the loader's arithmetic and the planner run on them); some are admitted outright."""
    verdicts: list[str | None] = []

    @settings(max_examples=200, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(job=training_jobs())
    def draw(job: dict[str, Any]) -> None:
        verdicts.append(_core_verdict(job, 1 << 18))

    draw()
    admitted = sum(v is None for v in verdicts)
    shallow = sum(v is not None and ("unknown key" in v or "expected a" in v) for v in verdicts)
    assert admitted >= len(verdicts) // 10, (admitted, len(verdicts))
    assert shallow <= len(verdicts) // 2, (shallow, len(verdicts))

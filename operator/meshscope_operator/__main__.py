"""``meshscope-operator``: build the settings from the environment once, register the handlers, run kopf.

Exists as the one entry point of the operator's container (operator/README.md). Every setting is an environment
variable (:mod:`~meshscope_operator.settings`; ``--help`` lists them); a bad one ends the process at once with one
line, ``meshscope-operator: error: ...``, and exit status 2, before kopf starts.

It must not hold logic: it reads, registers and runs.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import sys
from dataclasses import fields
from typing import TYPE_CHECKING, Any

from meshscope_operator.settings import OperatorSettings, SettingsError, env_name, settings_from

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

EXIT_USAGE = 2
PRIORITY_RANGE = 1 << 30
"""A peered replica's kopf priority is drawn from 1 .. this: two replicas tie once in ~10^9 starts."""


def _parser() -> argparse.ArgumentParser:
    names = ", ".join(env_name(f.name) for f in fields(OperatorSettings))
    return argparse.ArgumentParser(
        prog="meshscope-operator",
        description="The meshscope Kubernetes operator: admission webhooks for TrainingJobs and training pods. "
        f"Configured by environment variables only: {names} (docs/operator.md).",
    )


def _login(**kwargs: Any) -> object:  # noqa: ANN401 - kopf's login kwargs
    """Credentials for kopf: the pod's service account, else the kubeconfig; ``None`` when neither is there."""
    import kopf  # noqa: PLC0415

    return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    """Run the operator until it is stopped; returns the exit status.

    Args:
        argv: command-line arguments without the program name (default ``sys.argv[1:]``); only ``--help``.
        environ: the environment (default ``os.environ``).
    """
    _parser().parse_args(sys.argv[1:] if argv is None else list(argv))
    try:
        settings = settings_from(os.environ if environ is None else environ)
    except SettingsError as exc:
        sys.stderr.write(f"meshscope-operator: error: {exc}\n")
        return EXIT_USAGE
    logging.basicConfig(
        level=getattr(logging, settings.log_level.upper()), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    import kopf  # noqa: PLC0415 - a bad setting is reported without paying for kopf's import

    from meshscope_operator.handlers import register  # noqa: PLC0415

    registry = kopf.OperatorRegistry()
    # A registry of our own has none of the login handlers kopf's default one adds: without this the operator ends
    # at start with "Ran out of valid credentials" (tests/chart/test_chart_runs_the_operator.py runs it as the
    # image does). In a pod the service account's token; outside one, $KUBECONFIG or ~/.kube/config (kopf docs,
    # "Authentication").
    kopf.on.login(registry=registry)(_login)
    register(registry, settings)
    liveness = f"http://0.0.0.0:{settings.liveness_port}/healthz" if settings.liveness_port else None
    kopf.run(
        registry=registry,
        standalone=not settings.peering,
        peering_name=settings.peering or None,
        # kopf pauses every operator that sees a live peer of its own priority: replicas left at the default (0)
        # all paused, and no TrainingJob was handled. Each process draws its own; the highest handles them.
        priority=secrets.randbelow(PRIORITY_RANGE) + 1 if settings.peering else 0,
        clusterwide=not settings.namespaces,
        namespaces=settings.namespaces,
        liveness_endpoint=liveness,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

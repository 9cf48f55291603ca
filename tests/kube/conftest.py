"""The emulated cluster and the operator on it, once per module (tests/kube_serving.py)."""

from kube_serving import cluster, operator

__all__ = ["cluster", "operator"]

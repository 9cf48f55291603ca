"""A Kubernetes API server emulated on kmock for tests with the real ``kubectl`` and kopf (issue 11).

See :mod:`kube_emulator.emulator` for what it emulates and docs/operator.md, "Testing without a cluster", for what
it does not.
"""

from kube_emulator.emulator import KubeEmulator, make_server, parse_target
from kube_emulator.serving import RunningEmulator, write_kubeconfig

__all__ = ["KubeEmulator", "RunningEmulator", "make_server", "parse_target", "write_kubeconfig"]

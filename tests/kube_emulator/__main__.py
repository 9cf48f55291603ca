"""``python -m kube_emulator PORT KUBECONFIG``: serve the emulator on 127.0.0.1:PORT until SIGINT or SIGTERM.

The signals are blocked before the server's thread starts and taken with :func:`signal.sigwait`, so the process
exits the same way whichever thread the kernel would have picked and whatever the main thread was doing: no
reliance on a ``KeyboardInterrupt`` landing in the right place.
"""

import signal
import sys
from pathlib import Path

from kube_emulator.serving import RunningEmulator


def main() -> int:
    if len(sys.argv) != 3 or not sys.argv[1].isdigit():
        sys.stderr.write("usage: python -m kube_emulator PORT KUBECONFIG\n")
        return 2
    stops = {signal.SIGINT, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, stops)  # inherited by the server's thread, started below
    running = RunningEmulator(port=int(sys.argv[1]))
    try:
        running.kubeconfig(Path(sys.argv[2]))
        sys.stdout.write(f"serving {running.url}; kubeconfig {sys.argv[2]}\n")
        sys.stdout.flush()
        signal.sigwait(stops)
    finally:
        running.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

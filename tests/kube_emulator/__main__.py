"""``python -m kube_emulator PORT KUBECONFIG``: serve the emulator on 127.0.0.1:PORT until interrupted."""

import sys
import threading
from pathlib import Path

from kube_emulator.serving import RunningEmulator


def main() -> int:
    if len(sys.argv) != 3 or not sys.argv[1].isdigit():
        sys.stderr.write("usage: python -m kube_emulator PORT KUBECONFIG\n")
        return 2
    running = RunningEmulator(port=int(sys.argv[1]))
    running.kubeconfig(Path(sys.argv[2]))
    sys.stdout.write(f"serving {running.url}; kubeconfig {sys.argv[2]}\n")
    sys.stdout.flush()
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        running.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

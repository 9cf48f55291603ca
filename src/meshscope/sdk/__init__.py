"""meshscope's training-loop SDK: a few lines in a training script give one step record per rank per step.

```python
from meshscope import sdk

tracker = sdk.tracker_from_env()            # MESHSCOPE_DISABLE=1 -> a null tracker that does nothing
tracker.register_mesh(device_mesh)          # or tracker.register_groups({"tp": tp_group, "dp": dp_group})
for step in range(steps):
    with tracker.step(step):
        with tracker.phase("data"):
            batch = next(loader)
        tracker.data_stats(sequence_lengths=lengths)
        with tracker.phase("forward"):
            loss = model(batch)
        with tracker.phase("backward"):
            loss.backward()
        with tracker.phase("optimizer"):
            optimizer.step()
```

Collectives, point-to-point ops, attention time and peak memory are captured without further code (``docs/sdk.md``).
Importing this package is cheap and never imports torch; a real tracker imports it when it starts. The SDK must
never raise into, block, or change the results of the training loop.
"""

from __future__ import annotations

from meshscope.sdk.settings import TrackerSettings
from meshscope.sdk.tracker import PHASES, NullTracker, Tracker, TrackerCounters, tracker_from_env

__all__ = ["PHASES", "NullTracker", "Tracker", "TrackerCounters", "TrackerSettings", "tracker_from_env"]

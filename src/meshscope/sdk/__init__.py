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

for batch in tracker.data(loader):          # or: each fetch is the data phase of the step that uses the batch
    tracker.start_step()                    # no re-indenting: ends the previous step, opens the next
    ...
```

Collectives, point-to-point ops, attention time and peak memory are captured without further code (``docs/sdk.md``).
Importing this package is cheap and never imports torch; a real tracker imports it when it starts. The SDK must
never raise into, block, or change the results of the training loop.

Its modules: :mod:`~meshscope.sdk.settings` (the ``MESHSCOPE_*`` environment, :class:`TrackerSettings`),
:mod:`~meshscope.sdk.tracker` (:class:`Tracker`, :class:`NullTracker`), :mod:`~meshscope.sdk.steps` (a step's
intervals and its record), :mod:`~meshscope.sdk.capture` (the torch hooks that call a :class:`CaptureSink`),
:mod:`~meshscope.sdk.groups`, :mod:`~meshscope.sdk.clocks`, :mod:`~meshscope.sdk.measuring`, and
:mod:`~meshscope.sdk.transport`: the **wire protocol** between a training rank and whoever collects its records
(``meshscope run``'s collector, the sidecar): :class:`RecordSender` on the rank's side; :class:`RecordReader`
(the one reader, with a pluggable :class:`RecordSink`), :class:`RecordCollector` (it, writing a file),
:func:`decode` and :class:`RankTally` on the reader's side; :data:`RECORD_SCHEMA` and :data:`CONTROL_SCHEMA`.
The launcher and the sidecar set up a rank through the ``ENV_*`` names. Import the names from here;
:mod:`meshscope.sdk.huggingface` and :mod:`meshscope.sdk.lightning` (``Trainer`` callbacks) are imported by the
scripts that use them.
"""

from __future__ import annotations

from meshscope.sdk.settings import (
    ENV_COLLECTOR,
    ENV_DISABLE,
    ENV_GPU,
    ENV_JOB,
    ENV_LAYOUT,
    ENV_LAYOUT_IMPLIED,
    ENV_NETWORK_TIER,
    ENV_NODE,
    ENV_NVLINK_DOMAIN,
    TrackerSettings,
)
from meshscope.sdk.tracker import PHASES, NullTracker, Tracker, TrackerCounters, tracker_from_env
from meshscope.sdk.transport import (
    CONTROL_SCHEMA,
    RECORD_SCHEMA,
    AddressError,
    FileSink,
    RankTally,
    RecordCollector,
    RecordReader,
    RecordSender,
    RecordSink,
    decode,
    encode,
    parse_address,
)

__all__ = [
    "CONTROL_SCHEMA",
    "ENV_COLLECTOR",
    "ENV_DISABLE",
    "ENV_GPU",
    "ENV_JOB",
    "ENV_LAYOUT",
    "ENV_LAYOUT_IMPLIED",
    "ENV_NETWORK_TIER",
    "ENV_NODE",
    "ENV_NVLINK_DOMAIN",
    "PHASES",
    "RECORD_SCHEMA",
    "AddressError",
    "FileSink",
    "NullTracker",
    "RankTally",
    "RecordCollector",
    "RecordReader",
    "RecordSender",
    "RecordSink",
    "Tracker",
    "TrackerCounters",
    "TrackerSettings",
    "decode",
    "encode",
    "parse_address",
    "tracker_from_env",
]

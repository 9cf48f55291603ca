"""The simulator's parts; the public API is :mod:`meshscope.simulate` (import from there).

* :mod:`~meshscope.simulation.faults`: the named faults, their parameters, parsing and what they resolve to;
* :mod:`~meshscope.simulation.scenarios`: scenario files (YAML) and explicit phase durations;
* :mod:`~meshscope.simulation.model`: per-stage phase times and process groups, from the plan and the placement;
* :mod:`~meshscope.simulation.timeline`: the vectorised timeline and the record table it writes;
* :mod:`~meshscope.simulation.simulating`: ``simulate()``, tying plan, faults and timeline together;
* :mod:`~meshscope.simulation.commands`: ``meshscope simulate``.
"""

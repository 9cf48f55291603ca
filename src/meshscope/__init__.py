"""meshscope: which parallelism axis is costing your training run time, and what a layout will cost before you scale.

The core (this package) is pure: layouts, placement, the planner, the step breakdown, the cost table. It imports
nothing from Kubernetes, metrics exporters or NVML; the operator and the sidecar build on it.
"""

__version__ = "0.1.0"

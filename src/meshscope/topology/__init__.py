"""Where ranks run: the parallel layout, the placement of ranks on nodes and NVLink domains, the hardware catalogue.

The bottom of the core. Everything else (planner, records, SDK, breakdown, the sidecar's tagging, the operator's
placement checks) asks these objects which coord a rank has, which ranks form a group, which node and NVLink domain
a rank sits in, which link a group's traffic crosses and what a GPU or link can do; nobody recomputes strides.

- :mod:`~meshscope.topology.layout`: :class:`ParallelLayout` (degrees of the five mesh axes, the rank <-> coord
  mapping, groups), :class:`MeshAxis`, :data:`AXES`, the rank order (documented there, once) and
  :func:`parse_layout` for ``dp=2,tp=2,pp=2``;
- :mod:`~meshscope.topology.placement`: :class:`Placement` (rank -> node -> NVLink domain -> network tier, default
  or from explicit arrays, as the operator builds it from node labels), :class:`Link` and the vectorised
  :func:`axis_spans` / :func:`span_of_groups`;
- :mod:`~meshscope.topology.hardware`: the GPU catalogue with a source for every number (:data:`CATALOGUE`,
  :class:`GpuSpec`, :class:`HardwareConfig`, :func:`default_hardware`, :func:`custom_gpu`), units :data:`GB`,
  :data:`GiB`, :data:`TFLOPS`.

It must not know about TrainingJobs, plans, records or I/O, and imports nothing of meshscope but
:mod:`meshscope.errors`. Import the names from here (``from meshscope.topology import ParallelLayout``).
"""

from meshscope.topology.hardware import (
    CATALOGUE,
    EMULATED_GPU,
    GB,
    TFLOPS,
    GiB,
    GpuSpec,
    HardwareConfig,
    custom_gpu,
    default_hardware,
    lookup_gpu,
)
from meshscope.topology.layout import (
    AXES,
    DEFAULT_ORDER,
    MeshAxis,
    ParallelLayout,
    RankCoord,
    layout_text,
    parse_layout,
    parse_order,
)
from meshscope.topology.placement import GroupSpan, Link, Placement, axis_spans, span_of_groups

__all__ = [
    "AXES",
    "CATALOGUE",
    "DEFAULT_ORDER",
    "EMULATED_GPU",
    "GB",
    "TFLOPS",
    "GiB",
    "GpuSpec",
    "GroupSpan",
    "HardwareConfig",
    "Link",
    "MeshAxis",
    "ParallelLayout",
    "Placement",
    "RankCoord",
    "axis_spans",
    "custom_gpu",
    "default_hardware",
    "layout_text",
    "lookup_gpu",
    "parse_layout",
    "parse_order",
    "span_of_groups",
]

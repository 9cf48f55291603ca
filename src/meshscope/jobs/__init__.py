"""TrainingJobs: the typed spec, model configs and presets, loading a manifest and its cross-field rules.

A job reaches meshscope as a ``TrainingJob`` manifest (``crds/trainingjobs.meshscope.io.yaml`` is the wire format's
single source of truth) from ``meshscope plan FILE``, ``meshscope run --spec``, the operator's watch and its
validating webhook; it must mean the same thing in all four. This package turns YAML text, a file or a mapping into
a frozen :class:`JobSpec` with every default applied and every rule checked, or raises
:class:`~meshscope.errors.SpecError` naming the field, the value and what would fit.

- :mod:`~meshscope.jobs.models`: :class:`ModelConfig` (dense, MoE, MLA), parameter counts, :data:`PRESETS`;
- :mod:`~meshscope.jobs.spec`: :class:`JobSpec` and its sections, the closed sets (:class:`Precision`, ...);
- :mod:`~meshscope.jobs.validation`: :func:`check_job`, the arithmetic a schema cannot express (shared by the loader
  and the layout search, so both accept exactly the same jobs);
- :mod:`~meshscope.jobs.loading`: :func:`load_spec`, :func:`load_spec_text`, :func:`spec_from_manifest` (what the
  operator calls with the object it was handed) and the schema mirrors :data:`SECTION_KEYS`, :data:`BOUNDS`.

It must not plan, read records, or import anything Kubernetes: the operator hands the object over as a mapping.
Import the names from here (``from meshscope.jobs import load_spec``).
"""

from meshscope.jobs.loading import (
    API_VERSION,
    BOUNDS,
    KIND,
    SECTION_KEYS,
    load_spec,
    load_spec_text,
    load_yaml_mapping,
    spec_from_manifest,
)
from meshscope.jobs.models import (
    PRESETS,
    Activation,
    MLAConfig,
    ModelConfig,
    MoEConfig,
    Norm,
    PositionEmbedding,
    active_params,
    attention_params,
    embedding_params,
    layer_params,
    lookup_model,
    output_params,
    total_params,
)
from meshscope.jobs.spec import (
    AttentionImpl,
    CpCommType,
    JobSpec,
    MonitoringConfig,
    ParallelismConfig,
    PipelineSchedule,
    Precision,
    Recompute,
    TopologyConfig,
    TrainingConfig,
)
from meshscope.jobs.validation import check_job

__all__ = [
    "API_VERSION",
    "BOUNDS",
    "KIND",
    "PRESETS",
    "SECTION_KEYS",
    "Activation",
    "AttentionImpl",
    "CpCommType",
    "JobSpec",
    "MLAConfig",
    "MoEConfig",
    "ModelConfig",
    "MonitoringConfig",
    "Norm",
    "ParallelismConfig",
    "PipelineSchedule",
    "PositionEmbedding",
    "Precision",
    "Recompute",
    "TopologyConfig",
    "TrainingConfig",
    "active_params",
    "attention_params",
    "check_job",
    "embedding_params",
    "layer_params",
    "load_spec",
    "load_spec_text",
    "load_yaml_mapping",
    "lookup_model",
    "output_params",
    "spec_from_manifest",
    "total_params",
]

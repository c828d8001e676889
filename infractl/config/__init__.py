"""The one config loader: ``cluster.yaml`` and ``run.yaml`` as pydantic models (unknown fields
refused), each refusal one line naming the file and the field.

Rooms: ``spec`` (what every section shares), ``loader`` (the guarded YAML loader), ``cluster``
(cluster.yaml; each provider registers its own section), ``run`` (run.yaml), ``layout`` (batch
splits and layout checks the trainer shares). The names below are the public API.
"""

from __future__ import annotations

from infractl.config.batch import check_layout, even_passes, micro_batch, split_batch
from infractl.config.cluster import (
    IMAGE_REFERENCE,
    ClusterSpec,
    ProviderConfig,
    RuntimeSpec,
    cluster_model,
    default_cluster,
    default_cluster_name,
    load_cluster,
    parse_cluster,
    register_provider,
)
from infractl.config.loader import MAX_CONFIG_BYTES, MAX_CONFIG_DEPTH, MAX_CONFIG_NODES
from infractl.config.run import (
    DP_SHORTHANDS,
    MAX_PROFILE_STEPS,
    CheckpointSpec,
    DataSpec,
    EvalSpec,
    ModelSpec,
    NodeRange,
    ParallelSpec,
    PreemptionSpec,
    ProfileSpec,
    RestartSpec,
    RunSpec,
    WatchdogSpec,
    derive_run,
    load_run,
    load_run_json,
    parse_step_window,
)
from infractl.config.spec import NAME_PATTERN, Name, Spec, field_error

__all__ = [
    "DP_SHORTHANDS",
    "MAX_CONFIG_BYTES",
    "MAX_CONFIG_DEPTH",
    "MAX_CONFIG_NODES",
    "MAX_PROFILE_STEPS",
    "NAME_PATTERN",
    "CheckpointSpec",
    "ClusterSpec",
    "DataSpec",
    "EvalSpec",
    "ModelSpec",
    "Name",
    "NodeRange",
    "ParallelSpec",
    "PreemptionSpec",
    "ProfileSpec",
    "RestartSpec",
    "ProviderConfig",
    "RunSpec",
    "RuntimeSpec",
    "IMAGE_REFERENCE",
    "Spec",
    "WatchdogSpec",
    "check_layout",
    "even_passes",
    "cluster_model",
    "default_cluster",
    "default_cluster_name",
    "derive_run",
    "field_error",
    "load_cluster",
    "load_run",
    "load_run_json",
    "micro_batch",
    "parse_cluster",
    "parse_step_window",
    "register_provider",
    "split_batch",
]

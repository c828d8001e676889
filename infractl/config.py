"""The one config loader: ``cluster.yaml`` and ``run.yaml`` as pydantic models (unknown fields forbidden)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from infractl.errors import ConfigError

__all__ = [
    "ClusterSpec",
    "RuntimeSpec",
    "RunSpec",
    "ModelSpec",
    "DataSpec",
    "CheckpointSpec",
    "EvalSpec",
    "NodeRange",
    "WatchdogSpec",
    "PreemptionSpec",
    "load_cluster",
    "load_run",
    "load_run_json",
    "per_rank_batch",
    "default_cluster",
]

_NAME = r"^[a-z0-9][a-z0-9-]{0,39}$"
Name = Annotated[str, Field(pattern=_NAME, description="Lower-case letters, digits and '-', at most 40.")]


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RuntimeSpec(_Spec):
    """The pinned runtime every node must have; `up` refuses nodes that differ."""

    torch: str = Field("2.13.0", description="torch version every node must run (prefix match, e.g. 2.13.0).")
    image: str | None = Field(
        None, description="Container image pinned by digest for providers that run containers; unused on `local`."
    )


class ClusterSpec(_Spec):
    """cluster.yaml: where training runs."""

    name: Name = Field("local", description="Cluster name; state lives in .infractl/<name>/.")
    provider: Literal["local"] = Field("local", description="Infrastructure provider. `local`: nodes are process trees on this machine.")
    nodes: int = Field(2, ge=1, le=64, description="Number of training nodes.")
    processes_per_node: int = Field(1, ge=1, le=64, description="Training processes (ranks) per node.")
    store: str | None = Field(
        None, description="Object store URI for checkpoints and metrics (file:///abs/path). Default: .infractl/<name>/store."
    )
    runtime: RuntimeSpec = Field(default_factory=RuntimeSpec, description="Pinned runtime checked on every node.")


class ModelSpec(_Spec):
    """A GPT-style byte-level language model."""

    layers: int = Field(2, ge=1, le=96, description="Transformer blocks.")
    hidden: int = Field(64, ge=8, le=16384, description="Hidden size; must be divisible by heads.")
    heads: int = Field(2, ge=1, le=128, description="Attention heads.")
    seq_len: int = Field(64, ge=8, le=32768, description="Tokens (bytes) per sample.")

    @model_validator(mode="after")
    def _heads_divide_hidden(self) -> "ModelSpec":
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be divisible by heads ({self.heads})")
        return self


class DataSpec(_Spec):
    """Training text: `stdlib` (the Python standard library's .py files: on every machine, no
    download) or `prepared` (a directory written by `infractl data prepare`)."""

    source: Literal["stdlib", "prepared"] = Field("stdlib", description="Corpus to train on.")
    path: str | None = Field(None, description="Directory of a prepared dataset (source: prepared).")
    max_bytes: int = Field(4_000_000, ge=10_000, description="Use at most this many bytes of the corpus (source: stdlib).")
    val_fraction: float = Field(
        0.05, ge=0, lt=1, description="Share of documents held out for validation (source: stdlib; prepared datasets record their own)."
    )

    @model_validator(mode="after")
    def _path_matches_source(self) -> "DataSpec":
        if self.source == "prepared" and not self.path:
            raise ValueError("path is required when source is prepared (the directory `infractl data prepare` wrote)")
        if self.source == "stdlib" and self.path:
            raise ValueError("path is only used with source: prepared")
        return self


class CheckpointSpec(_Spec):
    every: int = Field(10, ge=1, description="Save a checkpoint every N steps (and at the last step).")
    keep: int = Field(2, ge=2, description="Committed checkpoints to keep (at least 2).")


class EvalSpec(_Spec):
    every: int = Field(0, ge=0, description="Compute the validation loss every N steps and at the last step (0 = never).")
    batches: int = Field(2, ge=1, description="Global batches of the validation split to average over.")


class NodeRange(_Spec):
    min: int = Field(1, ge=1, description="Fewest nodes the run may continue on.")
    max: int = Field(1, ge=1, description="Most nodes the run uses.")

    @model_validator(mode="after")
    def _ordered(self) -> "NodeRange":
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) must not exceed max ({self.max})")
        return self


class WatchdogSpec(_Spec):
    """Hang detection: a rank that stops making progress is turned into a failed node."""

    step_timeout_s: float = Field(
        300,
        ge=5,
        le=86400,
        description=(
            "After the first step of each (re)start, a rank that completes no training step for this long is "
            "killed by its node's torchrun agent and the run goes on as after a node failure. Also the "
            "collective timeout after that first step, so survivors of a hung peer do not wait the 30-minute default."
        ),
    )


class PreemptionSpec(_Spec):
    """What a SIGTERM (spot reclaim, maintenance notice) gives the run."""

    grace_s: int = Field(
        30,
        ge=1,
        le=3600,
        description=(
            "Seconds between SIGTERM to a node and SIGKILL of its workers. Within them every rank saves an "
            "emergency checkpoint of the current step and waits for it to commit; the next attempt resumes from it."
        ),
    )


class RunSpec(_Spec):
    """run.yaml: what to train and how."""

    name: Name = Field(description="Run name; re-running the same name resumes it.")
    model: ModelSpec = Field(default_factory=ModelSpec, description="Model size.")
    data: DataSpec = Field(default_factory=DataSpec, description="Training data.")
    batch_size: int = Field(16, ge=1, description="Global batch size (samples per step, all ranks together).")
    steps: int = Field(50, ge=1, description="Optimizer steps to train.")
    lr: float = Field(3e-3, gt=0, description="Peak learning rate (AdamW, linear warm-up then cosine decay).")
    seed: int = Field(0, ge=0, description="Seed for weights, data order and every RNG.")
    eval: EvalSpec = Field(default_factory=EvalSpec, description="Validation loss cadence.")
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec, description="Checkpoint cadence and retention.")
    parallel: Literal["ddp", "zero1", "fsdp"] = Field(
        "ddp",
        description=(
            "Parallel scheme. `ddp`: every rank holds everything. `zero1`: DDP with AdamW's state "
            "sharded over the ranks. `fsdp`: FSDP2, weights, gradients and optimizer state sharded."
        ),
    )
    activation_checkpointing: bool = Field(
        False, description="Recompute each transformer block's activations in the backward pass (less memory, more compute)."
    )
    mixed_precision: Literal["fp32", "bf16"] = Field(
        "fp32", description="`bf16`: compute in bfloat16 (weights and optimizer state stay fp32)."
    )
    cpu_offload: bool = Field(
        False, description="Keep sharded weights, gradients and optimizer state in host memory; `parallel: fsdp` only."
    )
    deterministic: bool = Field(
        False,
        description=(
            "Deterministic kernels and one CPU thread per rank: reruns and resumes on the same world size "
            "repeat every loss bit for bit (slower)."
        ),
    )
    nodes: NodeRange = Field(default_factory=NodeRange, description="Elastic node range {min, max}.")
    max_restarts: int = Field(
        3,
        ge=0,
        le=100,
        description=(
            "Times each node's torchrun agent may restart its workers after a failure, and times a node may "
            "rejoin the run (`infractl rejoin`): a flapping node cannot loop forever."
        ),
    )
    watchdog: WatchdogSpec = Field(default_factory=WatchdogSpec, description="Hang detection.")
    preemption: PreemptionSpec = Field(default_factory=PreemptionSpec, description="Grace period after SIGTERM.")

    @model_validator(mode="after")
    def _offload_needs_fsdp(self) -> "RunSpec":
        if self.cpu_offload and self.parallel != "fsdp":
            raise _field_error(
                "cpu_offload", f"needs parallel: fsdp (parallel is {self.parallel}); only FSDP shards can live on the CPU"
            )
        return self

    @field_validator("lr", mode="before")
    @classmethod
    def _yaml_float(cls, value: object) -> object:
        # YAML 1.1 reads "3e-3" as a string; accept it as the number the user meant.
        if isinstance(value, str) and re.fullmatch(r"[0-9.]+[eE][-+]?[0-9]+", value):
            return float(value)
        return value


def _field_error(field: str, message: str) -> ValidationError:
    """A cross-field error located at ``field``: a model validator's own errors have no location,
    and the loader reports ``<file>: <field>: <message>``."""
    return ValidationError.from_exception_data(
        "RunSpec",
        [InitErrorDetails(type=PydanticCustomError("value_error", message), loc=(field,), input=None)],
    )


def per_rank_batch(batch_size: int, world_size: int) -> int:
    """Samples per rank per step; ConfigError unless the global batch divides by ``world_size``."""
    if world_size < 1:
        raise ValueError("world_size must be at least 1")
    if batch_size % world_size:
        raise ConfigError(f"batch_size ({batch_size}) must be divisible by the world size ({world_size})")
    return batch_size // world_size


_M = TypeVar("_M", bound=BaseModel)


def _field_path(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def _load(path: Path, model: type[_M], what: str) -> _M:
    if not path.is_file():
        raise ConfigError(f"{what} file not found: {path}")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}{where}: not valid YAML ({getattr(exc, 'problem', exc)})") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror})") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of fields at the top level")
    return _validate(model, raw, path)


def _validate(model: type[_M], raw: object, source: Path) -> _M:
    try:
        if isinstance(raw, str):
            return model.model_validate_json(raw)
        return model.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = _field_path(tuple(err["loc"]))
        if err["type"] == "extra_forbidden":
            msg = "unknown field"
        else:
            msg = err["msg"].removeprefix("Value error, ")
        more = f" (and {len(exc.errors()) - 1} more)" if len(exc.errors()) > 1 else ""
        raise ConfigError(f"{source}: {field}: {msg}{more}") from None


def load_cluster(path: Path) -> ClusterSpec:
    return _load(path, ClusterSpec, "cluster")


def load_run(path: Path) -> RunSpec:
    return _load(path, RunSpec, "run")


def load_run_json(path: Path) -> RunSpec:
    """A resolved run spec as the launcher hands it to the trainers (``RunSpec.model_dump_json()``)."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror})") from None
    return _validate(RunSpec, text, path)


def default_cluster() -> ClusterSpec:
    """The embedded default: the local provider, 2 nodes x 1 process."""
    return ClusterSpec()

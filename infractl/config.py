"""The one config loader: ``cluster.yaml`` and ``run.yaml`` as pydantic models (unknown fields forbidden)."""

from __future__ import annotations

import ipaddress
import re
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from infractl.errors import ConfigError

__all__ = [
    "AwsSpec",
    "NetnsSpec",
    "NodeGroup",
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
    "ProfileSpec",
    "MAX_PROFILE_STEPS",
    "parse_step_window",
    "load_cluster",
    "load_run",
    "load_run_json",
    "derive_run",
    "split_batch",
    "check_layout",
    "ParallelSpec",
    "DP_SHORTHANDS",
    "default_cluster",
    "NAME_PATTERN",
    "MAX_CONFIG_BYTES",
    "MAX_CONFIG_DEPTH",
    "MAX_CONFIG_NODES",
]

#: Config files are small; anything larger is refused before it is parsed (parsing a 50 MB YAML
#: file takes half a minute). Nesting and the node count after alias expansion are bounded too:
#: a deep `[[[[...` exhausts the parser's recursion, and a few lines of nested aliases (the
#: "billion laughs") expand into more values than validation could ever walk.
MAX_CONFIG_BYTES = 1 << 20
MAX_CONFIG_DEPTH = 32
MAX_CONFIG_NODES = 100_000
# Longest key shown in a field path of an error message.
_MAX_KEY_SHOWN = 64

NAME_PATTERN = r"^[a-z0-9][a-z0-9-]{0,39}$"
Name = Annotated[str, Field(pattern=NAME_PATTERN, description="Lower-case letters, digits and '-', at most 40.")]


class _Spec(BaseModel):
    # No NaN or infinity in a number, no control character in a string (names, paths, URIs,
    # versions: none of them has one, and a NUL byte would only fail later, deep in the OS).
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, str_max_length=4096)

    @field_validator("*", mode="after")
    @classmethod
    def _printable(cls, value: object) -> object:
        if isinstance(value, str) and not value.isprintable():
            raise ValueError("must not contain control characters (newlines, tabs, NUL, escape sequences)")
        return value


class RuntimeSpec(_Spec):
    """The pinned runtime every node must have; `up` refuses nodes that differ."""

    torch: str = Field("2.13.0", description="torch version every node must run (prefix match, e.g. 2.13.0).")
    image: str | None = Field(
        None, description="Container image pinned by digest for providers that run containers; unused on `local`."
    )


_GROUP_NAME = r"^[a-z][a-z0-9]{0,15}$"
_AWS_ID = r"^{kind}-[0-9a-f]{{8,17}}$"


class NodeGroup(_Spec):
    """Training nodes of one instance type and market."""

    instance_type: str = Field(
        description="A training instance type of infra/aws/instances.json (p5.48xlarge, g5.12xlarge, ...)."
    )
    nodes: int = Field(ge=1, le=64, description="Nodes of this group.")
    spot: bool = Field(False, description="Spot instances (cheaper; may be reclaimed) instead of on-demand.")

    @field_validator("instance_type")
    @classmethod
    def _known_type(cls, value: str) -> str:
        from infractl.providers.aws import instance_types  # the table is data of infra/aws

        known = sorted(instance_types())
        if value not in known:
            raise ValueError(f"{value!r} is not a training instance type infra/aws knows ({', '.join(known)})")
        return value


class AwsSpec(_Spec):
    """Where and how the `aws` provider creates the cluster (infra/aws's variables; its README describes them)."""

    region: str = Field(pattern=r"^[a-z]{2}(-[a-z]+)+-[0-9]$", description="AWS region, e.g. us-east-1.")
    state_bucket: str = Field(
        pattern=r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$",
        description="Existing S3 bucket that holds the clusters' Terraform state (locked with S3 lock files).",
    )
    availability_zone: str | None = Field(
        None, description="Availability zone of a new subnet; required unless subnet_id is given."
    )
    node_groups: dict[Annotated[str, Field(pattern=_GROUP_NAME)], NodeGroup] = Field(
        min_length=1, max_length=8, description="Training nodes by group name; a node is named <group>-<index>."
    )
    vpc_id: str | None = Field(None, pattern=_AWS_ID.format(kind="vpc"), description="Existing VPC (with subnet_id).")
    subnet_id: str | None = Field(
        None, pattern=_AWS_ID.format(kind="subnet"), description="Existing subnet (with vpc_id)."
    )
    vpc_cidr: str = Field("10.42.0.0/16", description="CIDR of a new VPC (/16 to /24).")
    create_bucket: bool = Field(False, description="Create the store's bucket with the cluster.")
    bucket_force_destroy: bool = Field(False, description="Let `teardown --purge` delete a created bucket's objects.")
    noncurrent_version_days: int = Field(7, ge=1, le=365, description="Days a created bucket keeps old versions.")
    store_kms_key_arn: str | None = Field(None, description="KMS key for a created bucket (default: S3-managed).")
    key_name: str | None = Field(None, description="EC2 key pair for SSH through Session Manager.")
    controller_instance_type: str = Field("m7i.large", description="The controller (rendezvous) instance type.")
    rendezvous_port: int = Field(29400, ge=1024, le=65535, description="The rendezvous endpoint's port.")
    root_volume_gb: int = Field(200, ge=100, le=16384, description="Root volume of each node, GiB.")
    workdir: str = Field("/opt/dlami/nvme/infractl", description="Absolute path of each node's work directory.")
    ami_overrides: dict[str, str] = Field(default_factory=dict, description="AMI id per instance type.")
    tags: dict[str, str] = Field(default_factory=dict, description="Tags on every resource (infractl adds its own).")

    @model_validator(mode="after")
    def _network(self) -> AwsSpec:
        if (self.vpc_id is None) != (self.subnet_id is None):
            raise _field_error("subnet_id", "vpc_id and subnet_id go together: give both, or neither")
        if self.subnet_id is None and self.availability_zone is None:
            raise _field_error("availability_zone", "is required when the cluster creates its subnet")
        return self


class NetnsSpec(_Spec):
    """The `netns` provider's settings (infra/netns's variables; its README describes them)."""

    subnet: str | None = Field(
        None,
        description=(
            "Private IPv4 /24 of the cluster's bridge, e.g. 10.213.7.0/24: the host side is .1 (the rendezvous "
            "endpoint), node i is .(i+2). Default: one of 10.200.0.0/13 picked from the cluster's state directory."
        ),
    )

    @field_validator("subnet")
    @classmethod
    def _private_slash_24(cls, value: str | None) -> str | None:
        if value is None:
            return value
        try:
            network = ipaddress.IPv4Network(value)
        except ValueError:
            raise ValueError(f"{value!r} is not an IPv4 network in CIDR form (e.g. 10.213.7.0/24)") from None
        if network.prefixlen != 24 or not network.is_private:
            raise ValueError(f"{value!r} must be a private /24 (10.x.y.0/24, 172.16-31.x.0/24 or 192.168.x.0/24)")
        return str(network)


class ClusterSpec(_Spec):
    """cluster.yaml: where training runs."""

    name: Name = Field("local", description="Cluster name; state lives in .infractl/<name>/.")
    provider: Literal["local", "netns", "aws"] = Field(
        "local",
        description=(
            "Infrastructure provider. `local`: nodes are process trees on this machine. `netns`: nodes are network "
            "namespaces on this machine, each with its own address on a bridge and its own sshd (Linux, root). "
            "`aws`: GPU instances (infra/aws), configured by Ansible, training in the pinned container image."
        ),
    )
    nodes: int = Field(2, ge=1, le=64, description="Number of training nodes (on aws: the node groups' sum).")
    processes_per_node: int = Field(
        1, ge=1, le=64, description="Training processes (ranks) per node. Default: 1 on local, one per GPU on aws."
    )
    store: str | None = Field(
        None,
        description=(
            "Object store URI for checkpoints and metrics (file:///abs/path, s3://bucket/prefix). "
            "Default on local and netns: .infractl/<name>/store; aws needs an s3:// store."
        ),
    )
    runtime: RuntimeSpec = Field(default_factory=RuntimeSpec, description="Pinned runtime checked on every node.")
    aws: AwsSpec | None = Field(None, description="The `aws` provider's settings; only with provider: aws.")
    netns: NetnsSpec | None = Field(None, description="The `netns` provider's settings; only with provider: netns.")

    @model_validator(mode="before")
    @classmethod
    def _ranks_per_gpu(cls, data: Any) -> Any:
        """On aws, processes_per_node defaults to the GPUs of the node groups' instance type."""
        if not (isinstance(data, dict) and data.get("provider") == "aws" and "processes_per_node" not in data):
            return data
        groups = (data.get("aws") or {}).get("node_groups") if isinstance(data.get("aws"), dict) else None
        from infractl.providers.aws import instance_types

        table = instance_types()
        types = {g.get("instance_type") for g in (groups or {}).values() if isinstance(g, dict)}
        gpus = {table[t]["gpus"] for t in types if t in table}
        return data | {"processes_per_node": gpus.pop()} if len(gpus) == 1 else data

    @model_validator(mode="after")
    def _provider_settings(self) -> ClusterSpec:
        if self.netns is not None and self.provider != "netns":
            raise _field_error("netns", f"is for provider: netns (provider is {self.provider})")
        if self.provider != "aws":
            if self.aws is not None:
                raise _field_error("aws", f"is for provider: aws (provider is {self.provider})")
            return self
        if self.aws is None:
            raise _field_error("aws", "is required with provider: aws (region, state_bucket, node_groups)")
        if "processes_per_node" not in self.model_fields_set:
            raise _field_error(
                "processes_per_node",
                "is required when the node groups' instance types have different GPU counts (one rank per GPU)",
            )
        grouped = sum(g.nodes for g in self.aws.node_groups.values())
        if grouped != self.nodes:
            raise _field_error("nodes", f"{self.nodes} differs from the {grouped} node(s) of aws.node_groups")
        if self.store is None or not self.store.startswith("s3://"):
            raise _field_error("store", "provider aws needs an s3:// store (s3://bucket/prefix)")
        image = self.runtime.image
        if image is None or not re.search(r"@sha256:[0-9a-f]{64}$", image):
            raise _field_error(
                "runtime.image",
                "provider aws runs the trainer in a container: pin the image by digest (REPO@sha256:<64 hex>); "
                "a tag can point at other bytes tomorrow",
            )
        return self


class ModelSpec(_Spec):
    """A GPT-style byte-level language model."""

    layers: int = Field(2, ge=1, le=96, description="Transformer blocks.")
    hidden: int = Field(64, ge=8, le=16384, description="Hidden size; must be divisible by heads.")
    heads: int = Field(2, ge=1, le=128, description="Attention heads.")
    seq_len: int = Field(64, ge=8, le=32768, description="Tokens (bytes) per sample.")

    @model_validator(mode="after")
    def _heads_divide_hidden(self) -> ModelSpec:
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be divisible by heads ({self.heads})")
        return self


class DataSpec(_Spec):
    """Training text: `stdlib` (the Python standard library's .py files: on every machine, no
    download) or `prepared` (a directory written by `infractl data prepare`)."""

    source: Literal["stdlib", "prepared"] = Field("stdlib", description="Corpus to train on.")
    path: str | None = Field(None, description="Directory of a prepared dataset (source: prepared).")
    max_bytes: int = Field(
        4_000_000, ge=10_000, le=1 << 40, description="Use at most this many bytes of the corpus (source: stdlib)."
    )
    val_fraction: float = Field(
        0.05,
        ge=0,
        lt=1,
        description="Share of documents held out for validation (source: stdlib; prepared datasets record their own).",
    )

    @model_validator(mode="after")
    def _path_matches_source(self) -> DataSpec:
        if self.source == "prepared" and not self.path:
            raise ValueError("path is required when source is prepared (the directory `infractl data prepare` wrote)")
        if self.source == "stdlib" and self.path:
            raise ValueError("path is only used with source: prepared")
        return self


class CheckpointSpec(_Spec):
    every: int = Field(10, ge=1, le=10**9, description="Save a checkpoint every N steps (and at the last step).")
    keep: int = Field(2, ge=2, le=1000, description="Committed checkpoints to keep (at least 2).")


class EvalSpec(_Spec):
    every: int = Field(
        0, ge=0, le=10**9, description="Compute the validation loss every N steps and at the last step (0 = never)."
    )
    batches: int = Field(2, ge=1, le=10**6, description="Global batches of the validation split to average over.")


class NodeRange(_Spec):
    min: int = Field(1, ge=1, le=1024, description="Fewest nodes the run may continue on.")
    max: int = Field(1, ge=1, le=1024, description="Most nodes the run uses.")

    @model_validator(mode="after")
    def _ordered(self) -> NodeRange:
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) must not exceed max ({self.max})")
        return self


#: The data-parallel schemes, as ``parallel`` shorthands and ``parallel.dp_shard`` values.
DP_SHORTHANDS = {"ddp": "none", "zero1": "zero1", "fsdp": "fsdp"}


class ParallelSpec(_Spec):
    """How the ranks share the work: a mesh of pipeline (pp) x data (dp) x tensor (tp) parallel
    ranks. The strings `ddp`, `zero1` and `fsdp` are shorthands for data parallel alone."""

    dp: int | Literal["auto"] = Field(
        "auto",
        description=(
            "Data-parallel degree: model replicas (or shard groups) that split the global batch. `auto`: the "
            "world size / (tp x pp), so the run follows an elastic node range."
        ),
    )
    dp_shard: Literal["none", "zero1", "fsdp"] = Field(
        "none",
        description=(
            "How the data-parallel ranks hold the model. `none`: each holds it all (DDP). `zero1`: DDP with "
            "AdamW's state sharded (tp and pp 1 only). `fsdp`: FSDP2, weights, gradients and optimizer state "
            "sharded over dp."
        ),
    )
    tp: int = Field(
        1,
        ge=1,
        le=64,
        description=(
            "Tensor-parallel degree: ranks that split each block's attention heads and MLP (and, between "
            "them, the tokens: sequence parallel); divides heads and seq_len."
        ),
    )
    pp: int = Field(1, ge=1, le=64, description="Pipeline-parallel degree: stages the blocks are cut into.")
    pp_schedule: Literal["gpipe", "1f1b", "interleaved-1f1b"] = Field(
        "1f1b",
        description=(
            "Pipeline schedule. `gpipe`: all forwards, then all backwards (activations of every micro-batch "
            "held at once). `1f1b`: one forward, one backward, so a stage holds at most pp micro-batches. "
            "`interleaved-1f1b`: 1f1b with two stages per rank, a smaller idle bubble (model.layers must "
            "divide by 2 x pp)."
        ),
    )
    microbatches: int | None = Field(
        None,
        ge=1,
        le=4096,
        description=(
            "Micro-batches each pipeline step splits a rank's batch into; at least pp (the default). More "
            "shrink the pipeline's idle bubble."
        ),
    )

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, value: object) -> object:
        if isinstance(value, str) and value in DP_SHORTHANDS:
            return {"dp_shard": DP_SHORTHANDS[value]}
        if isinstance(value, str) or not isinstance(value, dict | ParallelSpec):
            raise ValueError(
                f"must be one of {', '.join(DP_SHORTHANDS)} or a mapping of dp, dp_shard, tp, pp, "
                f"pp_schedule, microbatches (got {value!r})"
            )
        return value

    @field_validator("dp", mode="before")
    @classmethod
    def _auto_or_count(cls, value: object) -> object:
        if value != "auto" and (type(value) is not int or not 1 <= value <= 4096):
            raise ValueError(f"must be `auto` or a whole number from 1 to 4096 (got {value!r})")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> ParallelSpec:
        if self.dp_shard == "zero1" and (self.tp > 1 or self.pp > 1):
            raise _field_error("dp_shard", "zero1 needs tp: 1 and pp: 1; use fsdp to shard alongside tp or pp")
        if self.pp_schedule == "interleaved-1f1b" and self.pp == 1:
            raise _field_error("pp_schedule", "interleaved-1f1b needs pp of at least 2")
        if self.microbatches is not None and self.microbatches < self.pp:
            raise _field_error(
                "microbatches",
                f"{self.microbatches} is fewer than the pipeline's {self.pp} stage(s); a step needs "
                "at least one micro-batch per stage",
            )
        return self

    @property
    def scheme(self) -> Literal["ddp", "zero1", "fsdp"]:
        """The data-parallel scheme's shorthand: `ddp`, `zero1` or `fsdp`."""
        return "ddp" if self.dp_shard == "none" else self.dp_shard

    @property
    def model_ranks(self) -> int:
        """Ranks that hold one copy of the model between them: tp x pp."""
        return self.tp * self.pp

    @property
    def stages(self) -> int:
        """Pipeline stages: one per pipeline rank, two with interleaved-1f1b."""
        return self.pp * (2 if self.pp_schedule == "interleaved-1f1b" else 1)

    @property
    def n_microbatches(self) -> int:
        return self.microbatches or self.pp

    @property
    def label(self) -> str:
        """Short name of the layout: the shorthand for data parallel alone, else e.g.
        `fsdp x tp2`, `ddp x pp2 (1f1b, 4 micro-batches)`."""
        parts = [self.scheme if self.dp == "auto" else f"{self.scheme}{self.dp}"]
        if self.tp > 1:
            parts.append(f"tp{self.tp}")
        if self.pp > 1:
            parts.append(f"pp{self.pp} ({self.pp_schedule}, {self.n_microbatches} micro-batches)")
        return " x ".join(parts)

    def dp_degree(self, world_size: int) -> int:
        """The data-parallel degree at ``world_size``; ValueError (a sentence naming the field)
        when the layout cannot run on that many ranks."""
        if world_size % self.model_ranks:
            raise ValueError(
                f"tp x pp = {self.model_ranks} rank(s) per model copy does not divide the world size {world_size}"
            )
        dp = world_size // self.model_ranks
        if self.dp != "auto" and self.dp != dp:
            raise ValueError(
                f"dp {self.dp} x tp {self.tp} x pp {self.pp} = {self.dp * self.model_ranks} rank(s), "
                f"not the world size {world_size}; use dp: auto to follow the world size"
            )
        return dp


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


#: Most steps one profile window may hold: a trace of every op with its input shapes grows by
#: megabytes per step on every rank, and a few steps show a steady state as well as many.
MAX_PROFILE_STEPS = 50
_WINDOW = re.compile(r"^([0-9]{1,10}):([0-9]{1,10})$")


def parse_step_window(text: str) -> tuple[int, int]:
    """``"A:B"`` as (A, B): steps A to B of the run, both included (``"5:5"`` is one step).
    ``ValueError`` with a message to show after the field's name when it is anything else."""
    match = _WINDOW.fullmatch(text)
    if match is None:
        raise ValueError(f"must be FIRST:LAST, the first and last step to profile (both included), not {text!r}")
    first, last = int(match.group(1)), int(match.group(2))
    if first < 1:
        raise ValueError(f"{text}: steps count from 1")
    if last < first:
        raise ValueError(f"{text}: the last step ({last}) comes before the first ({first})")
    if last - first + 1 > MAX_PROFILE_STEPS:
        raise ValueError(
            f"{text} is {last - first + 1} steps; a window holds at most {MAX_PROFILE_STEPS} (traces grow fast)"
        )
    return first, last


class ProfileSpec(_Spec):
    """torch.profiler traces of a few steps on every rank, uploaded to the store (trainer/profiling.py)."""

    steps: str | None = Field(
        None,
        json_schema_extra={"pattern": _WINDOW.pattern},
        description=(
            f"FIRST:LAST, quoted: trace steps FIRST to LAST, both included (at most {MAX_PROFILE_STEPS}), on "
            "every rank, into runs/<run>/profiles/FIRST-LAST/rank-<r>.pt.trace.json.gz. Unset: no trace."
        ),
    )

    @field_validator("steps", mode="before")
    @classmethod
    def _window(cls, value: object) -> object:
        if isinstance(value, int) and not isinstance(value, bool):
            # YAML 1.1 reads an unquoted 3:5 as the base-60 number 185: nothing to recover it from.
            raise ValueError(
                f'must be FIRST:LAST in quotes, e.g. "3:5" (YAML read a number, {value}: unquoted, 3:5 is 185)'
            )
        if isinstance(value, str):
            parse_step_window(value)
        return value

    @property
    def window(self) -> tuple[int, int] | None:
        """(first, last) step to profile, both included; None when profiling is off."""
        return None if self.steps is None else parse_step_window(self.steps)


class RunSpec(_Spec):
    """run.yaml: what to train and how."""

    name: Name = Field(description="Run name; re-running the same name resumes it.")
    model: ModelSpec = Field(default_factory=ModelSpec, description="Model size.")
    data: DataSpec = Field(default_factory=DataSpec, description="Training data.")
    batch_size: int = Field(
        16, ge=1, le=1 << 20, description="Global batch size (samples per step, all ranks together)."
    )
    steps: int = Field(50, ge=1, le=10**9, description="Optimizer steps to train.")
    lr: float = Field(3e-3, gt=0, le=10, description="Peak learning rate (AdamW, linear warm-up then cosine decay).")
    seed: int = Field(0, ge=0, lt=2**63, description="Seed for weights, data order and every RNG.")
    eval: EvalSpec = Field(default_factory=EvalSpec, description="Validation loss cadence.")
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec, description="Checkpoint cadence and retention.")
    log_every: int = Field(
        10,
        ge=1,
        le=10_000,
        description=(
            "Read the steps' losses, gradient norms and the preemption flag back from the devices every N steps "
            "(and on checkpoint steps and the last step), in one small collective: the steps between keep the "
            "device busy with no host synchronization. Every step still gets its metrics record. A preemption "
            "notice is acted on at the next such step, so N x step time must stay well inside preemption.grace_s."
        ),
    )
    parallel: ParallelSpec = Field(
        default_factory=ParallelSpec,
        description=(
            "How the ranks share the work. Shorthands: `ddp` (every rank holds everything), `zero1` (DDP with "
            "AdamW's state sharded over the ranks), `fsdp` (FSDP2: weights, gradients and optimizer state "
            "sharded). Or a mesh: {dp, dp_shard, tp, pp, pp_schedule, microbatches}."
        ),
    )
    activation_checkpointing: bool = Field(
        False,
        description="Recompute each transformer block's activations in the backward pass (less memory, more compute).",
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
    profile: ProfileSpec = Field(default_factory=ProfileSpec, description="torch.profiler traces of chosen steps.")

    @model_validator(mode="after")
    def _offload_needs_fsdp(self) -> RunSpec:
        if self.cpu_offload and self.parallel.dp_shard != "fsdp":
            raise _field_error(
                "cpu_offload",
                f"needs parallel: fsdp (parallel is {self.parallel.label}); only FSDP shards can live on the CPU",
            )
        return self

    @model_validator(mode="after")
    def _layout_fits_model(self) -> RunSpec:
        parallel, model = self.parallel, self.model
        if model.heads % parallel.tp or model.hidden % parallel.tp:
            raise _field_error(
                "parallel.tp",
                f"{parallel.tp} must divide model.heads ({model.heads}) and model.hidden ({model.hidden}): "
                "each tensor-parallel rank takes whole attention heads",
            )
        if model.seq_len % parallel.tp:
            raise _field_error(
                "parallel.tp",
                f"{parallel.tp} must divide model.seq_len ({model.seq_len}): sequence parallel splits each "
                "sample's tokens over the tensor-parallel ranks",
            )
        if model.layers % parallel.stages:
            raise _field_error(
                "parallel.pp",
                f"{parallel.stages} stage(s) ({parallel.pp_schedule}) must split model.layers ({model.layers}) evenly",
            )
        if isinstance(parallel.dp, int) and self.batch_size < parallel.dp:
            raise _field_error(
                "batch_size", f"{self.batch_size} is smaller than parallel.dp ({parallel.dp}): a replica would idle"
            )
        return self

    @model_validator(mode="after")
    def _profile_within_steps(self) -> RunSpec:
        window = self.profile.window
        if window is not None and window[1] > self.steps:
            raise _field_error("profile.steps", f"{self.profile.steps} ends after the run's last step ({self.steps})")
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


def split_batch(batch_size: int, parts: int) -> list[int]:
    """Samples each of ``parts`` data-parallel ranks takes of a global batch of ``batch_size``:
    as even as can be, the first ``batch_size % parts`` ranks one more than the rest."""
    if parts < 1:
        raise ValueError("parts must be at least 1")
    base, extra = divmod(batch_size, parts)
    return [base + (i < extra) for i in range(parts)]


def check_layout(spec: RunSpec, worlds: Iterable[tuple[int, str]], *, file: str) -> None:
    """ConfigError naming the field unless ``spec.parallel`` runs on every world size of
    ``worlds``: (ranks, how that many ranks arise, e.g. "3 node(s) x 1 process(es)")."""
    parallel = spec.parallel
    for ranks, how in worlds:
        try:
            dp = parallel.dp_degree(ranks)
        except ValueError as exc:
            raise ConfigError(f"{exc} ({how})", file=file, field="parallel") from None
        if spec.batch_size < dp:
            raise ConfigError(
                f"{spec.batch_size} is smaller than the {dp} data-parallel rank(s) of {how}: a rank would idle",
                file=file,
                field="batch_size",
            )
        micro = parallel.n_microbatches
        if parallel.pp > 1 and spec.batch_size % (dp * micro):
            raise ConfigError(
                f"{spec.batch_size} does not split into {dp} data-parallel rank(s) x {micro} pipeline "
                f"micro-batches of equal size ({how}); the pipeline needs equal micro-batches",
                file=file,
                field="batch_size",
            )


_M = TypeVar("_M", bound=BaseModel)


def _field_path(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
            continue
        key = part if len(part) <= _MAX_KEY_SHOWN else part[:_MAX_KEY_SHOWN] + "…"
        out += f".{key}" if out else key
    return out or "(top level)"


# libyaml when PyYAML has it (about 20x faster), else the pure-Python loader: same documents.
_LOADER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _read_text(path: Path, what: str) -> str:
    """The file's text, refused early when it is missing, special, too big or not UTF-8."""
    try:
        info = path.stat()
    except FileNotFoundError:
        raise ConfigError(f"{what} file not found: {path}") from None
    except OSError as exc:
        raise ConfigError(f"cannot read ({exc.strerror})", file=str(path)) from None
    if not stat.S_ISREG(info.st_mode):
        kind = "a directory" if stat.S_ISDIR(info.st_mode) else "not a regular file"
        raise ConfigError(f"{what} file expected, this is {kind}", file=str(path))
    if info.st_size > MAX_CONFIG_BYTES:
        raise _too_big(path, info.st_size)
    try:
        with path.open("rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)  # the file may have grown since stat()
    except OSError as exc:
        raise ConfigError(f"cannot read ({exc.strerror})", file=str(path)) from None
    if len(data) > MAX_CONFIG_BYTES:
        raise _too_big(path, len(data))
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"not UTF-8 text (invalid byte at offset {exc.start})", file=str(path)) from None


def _too_big(path: Path, size: int) -> ConfigError:
    return ConfigError(f"{size:,} bytes; a config file may have at most {MAX_CONFIG_BYTES:,} (1 MiB)", file=str(path))


def _yaml_error(path: Path, exc: yaml.YAMLError) -> ConfigError:
    mark = getattr(exc, "problem_mark", None)
    where = f"line {mark.line + 1}: " if mark else ""
    problem = getattr(exc, "problem", None) or str(exc)
    return ConfigError(f"{where}not valid YAML ({' '.join(str(problem).split())})", file=str(path))


def _check_shape(text: str, path: Path) -> None:
    """Refuse nesting deeper than MAX_CONFIG_DEPTH and more than MAX_CONFIG_NODES values once
    aliases are expanded, from the parser's event stream (iterative: nothing is built yet)."""
    frames: list[tuple[str | None, int]] = []  # (anchor, values so far) per open collection
    sizes: dict[str, int] = {}  # anchor -> values it expands to
    total = 0
    try:
        for event in yaml.parse(text, Loader=_LOADER):
            if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
                if len(frames) >= MAX_CONFIG_DEPTH:
                    line = event.start_mark.line + 1 if event.start_mark else "?"
                    raise ConfigError(f"line {line}: nested deeper than {MAX_CONFIG_DEPTH} levels", file=str(path))
                frames.append((event.anchor, 1))
                continue
            if isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
                anchor, count = frames.pop()
                if anchor is not None:
                    sizes[anchor] = count
                added = count
            elif isinstance(event, yaml.ScalarEvent):
                added = 1
                if event.anchor is not None:
                    sizes[event.anchor] = 1
            elif isinstance(event, yaml.AliasEvent):
                added = sizes.get(event.anchor or "", 1)
            else:
                continue
            if frames:
                anchor, count = frames[-1]
                frames[-1] = (anchor, count + added)
            total = max(total, added, sum(count for _anchor, count in frames))
            if total > MAX_CONFIG_NODES:
                raise ConfigError(
                    f"expands to more than {MAX_CONFIG_NODES:,} values (aliases included)", file=str(path)
                )
    except yaml.YAMLError as exc:
        raise _yaml_error(path, exc) from None


def _load(path: Path, model: type[_M], what: str) -> _M:
    text = _read_text(path, what)
    _check_shape(text, path)
    try:
        raw = yaml.load(text, Loader=_LOADER)
    except yaml.YAMLError as exc:
        raise _yaml_error(path, exc) from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError("expected a mapping of fields at the top level", file=str(path))
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
        raise ConfigError(f"{msg}{more}", file=str(source), field=field) from None


def load_cluster(path: Path) -> ClusterSpec:
    return _load(path, ClusterSpec, "cluster")


def load_run(path: Path) -> RunSpec:
    return _load(path, RunSpec, "run")


def load_run_json(path: Path) -> RunSpec:
    """A resolved run spec as the launcher hands it to the trainers (``RunSpec.model_dump_json()``)."""
    return _validate(RunSpec, _read_text(path, "run"), path)


def derive_run(source: RunSpec, run_file: Path, *, suffix: str, **changes: Any) -> RunSpec:
    """A run made from ``source`` for a measurement (``plan --measure``, ``bench``): named
    ``<source name><suffix>`` (the name shortened to fit), with ``changes`` to its top-level
    fields, and validated like run.yaml (a change that breaks it names ``run_file`` and the field)."""
    name = source.name[: 40 - len(suffix)].rstrip("-") + suffix
    return _validate(RunSpec, source.model_dump(mode="json") | {"name": name, **changes}, run_file)


def default_cluster() -> ClusterSpec:
    """The embedded default: the local provider, 2 nodes x 1 process."""
    return ClusterSpec()

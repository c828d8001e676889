"""run.yaml: what to train and how (``RunSpec`` and its sections), loaded through the guarded loader."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from infractl.config.loader import load, read_text, validate
from infractl.config.spec import Name, Spec, field_error
from trainer.faults import HOOKS

__all__ = [
    "DP_SHORTHANDS",
    "MAX_PROFILE_STEPS",
    "CheckpointSpec",
    "DataSpec",
    "EvalSpec",
    "ModelSpec",
    "NodeRange",
    "ParallelSpec",
    "PreemptionSpec",
    "ProfileSpec",
    "RestartSpec",
    "RunSpec",
    "WatchdogSpec",
    "derive_run",
    "load_run",
    "load_run_json",
    "parse_step_window",
]


class ModelSpec(Spec):
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


class DataSpec(Spec):
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


#: checkpoint.replicate_every's default. bench/trainer.py on 2 CPU cores (docs/performance.md): one
#: replica costs about half a step's time (135 ms against 272 ms), so every 100 steps it costs 0.5%.
REPLICATE_EVERY = 100


class CheckpointSpec(Spec):
    every: int = Field(10, ge=1, le=10**9, description="Save a checkpoint every N steps (and at the last step).")
    keep: int = Field(2, ge=2, le=1000, description="Committed checkpoints to keep (at least 2).")
    replicate_every: int = Field(
        REPLICATE_EVERY,
        ge=0,
        le=10**9,
        description=(
            "Every N steps, each rank's checkpoint shard is also held in host memory on its own node and the "
            "next one (0 = never): a restart then resumes from the newest replica every rank can still reach, "
            "not the store's older commit. Replicas are never committed to the store."
        ),
    )


class EvalSpec(Spec):
    every: int = Field(
        0, ge=0, le=10**9, description="Compute the validation loss every N steps and at the last step (0 = never)."
    )
    batches: int = Field(2, ge=1, le=10**6, description="Global batches of the validation split to average over.")


class NodeRange(Spec):
    min: int = Field(1, ge=1, le=1024, description="Fewest nodes the run may continue on.")
    max: int = Field(1, ge=1, le=1024, description="Most nodes the run uses.")

    @model_validator(mode="after")
    def _ordered(self) -> NodeRange:
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) must not exceed max ({self.max})")
        return self


#: The data-parallel schemes, as ``parallel`` shorthands and ``parallel.dp_shard`` values.
DP_SHORTHANDS = {"ddp": "none", "zero1": "zero1", "fsdp": "fsdp"}


class ParallelSpec(Spec):
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
            raise field_error("dp_shard", "zero1 needs tp: 1 and pp: 1; use fsdp to shard alongside tp or pp")
        if self.pp_schedule == "interleaved-1f1b" and self.pp == 1:
            raise field_error("pp_schedule", "interleaved-1f1b needs pp of at least 2")
        if self.microbatches is not None and self.microbatches < self.pp:
            raise field_error(
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


class WatchdogSpec(Spec):
    """Hang detection: a rank that stops making progress is turned into a failed node."""

    step_timeout_s: float = Field(
        300,
        ge=5,
        le=86400,
        description=(
            "After the first step of each (re)start, a rank that completes no training step for this long is "
            "killed by its node's torchrun agent and the run goes on as after a node failure. Half of it bounds "
            "the collective timeout after that first step, so survivors of a hung peer do not wait the 30-minute "
            "default."
        ),
    )
    collective_timeout_min_s: float = Field(
        5,
        ge=1,
        le=86400,
        description=(
            "The least time a collective of the training step waits for the slowest rank before the waiting "
            "ranks count a peer as hung and restart. The timeout is 10 times the slowest step this rank has "
            "seen since its (re)start, at least this, at most half of step_timeout_s (which it starts at)."
        ),
    )


class PreemptionSpec(Spec):
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


class RestartSpec(Spec):
    """How soon the workers train again after a failure: torchrun's rendezvous and their start."""

    warm: bool = Field(
        True,
        description=(
            "Workers are forked from a process on each node that has already imported torch and the trainer "
            "(torchrun's forkserver start method) instead of starting a new Python each time: about 2 s less per "
            "restart on a CPU node."
        ),
    )
    keep_alive_s: int = Field(
        1, ge=1, le=60, description="Seconds between two keep-alives from each node's agent to the rendezvous."
    )
    keep_alive_misses: int = Field(
        3,
        ge=2,
        le=10,
        description=(
            "Keep-alives a node may miss before the rendezvous drops it: a dead node holds the survivors' restart "
            "for up to keep_alive_s x keep_alive_misses. A live node whose keep-alives come that late (its "
            "machine stalled) is dropped too, and restarts its workers to join again: raise both on a large or "
            "overloaded cluster."
        ),
    )
    launch_wait_s: int = Field(
        30,
        ge=1,
        le=600,
        description=(
            "Once nodes.min nodes joined a launch's first rendezvous, seconds it waits for the other nodes the run "
            "was launched on before it starts without them (one that comes later restarts the run to join it). "
            "A launch whose nodes all join starts at once."
        ),
    )
    last_call_s: int = Field(
        1,
        ge=1,
        le=300,
        description=(
            "A restart's rendezvous closes as soon as every live node joined; seconds it waits, once nodes.min "
            "nodes joined, for a live node that does not join (its workers hung)."
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


class ProfileSpec(Spec):
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


#: Variables a run.yaml ``env:`` may not name: infractl's own (the launcher sets them), and those
#: that change which code a node's processes run rather than what they do.
_UNPASSABLE_PREFIXES = ("INFRACTL_", "TORCHELASTIC_", "LD_", "PYTHON")
_UNPASSABLE = frozenset({"BASH_ENV", "ENV", "PATH", "HOME", "SHELL", "IFS", "PS4"})


class RunSpec(Spec):
    """run.yaml: what to train and how."""

    name: Name = Field(description="Run name; re-running the same name resumes it.")
    model: ModelSpec = Field(default_factory=ModelSpec, description="Model size.")
    data: DataSpec = Field(default_factory=DataSpec, description="Training data.")
    batch_size: int = Field(
        16, ge=1, le=1 << 20, description="Global batch size (samples per step, all ranks together)."
    )
    micro_batch: int | None = Field(
        None,
        ge=1,
        le=1 << 20,
        description=(
            "The most samples a data-parallel rank puts through one forward/backward pass: a larger share of the "
            "batch is taken in several passes whose gradients add up (gradient accumulation), so activations are "
            "sized by it while the global batch stays. Unset: a rank's share on `nodes.max` nodes. Not with "
            "pipeline stages (`parallel.microbatches` splits their batch)."
        ),
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
    min_step_s: float = Field(
        0,
        ge=0,
        le=10,
        description=(
            "The least time a step takes: each rank waits out the rest after the step (0: never waits). For "
            "rehearsals: a drill or chaos series on a small run keeps it training through the series at little "
            "CPU. The metrics still record each step's own time."
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
    restart: RestartSpec = Field(
        default_factory=RestartSpec, description="How soon workers train again after a failure."
    )
    profile: ProfileSpec = Field(default_factory=ProfileSpec, description="torch.profiler traces of chosen steps.")
    env: list[str] = Field(
        [],
        max_length=64,
        description=(
            "Names of variables of the shell that runs `infractl train` that the trainers get too (an access "
            "token their code reads, NCCL_DEBUG, ...): nothing else of that environment reaches a node but the "
            "store's credentials where the nodes have no role of their own. Each must be set when the run "
            "starts. Not infractl's own variables (but, in a `rehearsal`, the trainer's fault-injection hooks), "
            "nor the dynamic loader's or Python's (LD_*, PYTHON*)."
        ),
    )
    rehearsal: bool = Field(
        False,
        description=(
            "A rehearsal: a run drills and tests inject faults into through the trainer's fault-injection hooks "
            "(trainer/faults.py: a delayed checkpoint upload, corrupted weights, corrupted replicas), which its "
            "`env:` may then pass. A run that is not one refuses them."
        ),
    )

    @field_validator("env")
    @classmethod
    def _passable_names(cls, names: list[str]) -> list[str]:
        for name in names:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,127}", name):
                raise ValueError(f"{name!r} is not an environment variable's name")
            if (name.startswith(_UNPASSABLE_PREFIXES) or name in _UNPASSABLE) and name not in HOOKS:
                raise ValueError(
                    f"{name} cannot be passed to the trainers: infractl sets it itself, or it changes what code "
                    "the node runs (LD_*, PYTHON*, BASH_ENV)"
                )
        if len(set(names)) != len(names):
            raise ValueError("names a variable twice")
        return names

    @model_validator(mode="after")
    def _hooks_only_in_a_rehearsal(self) -> RunSpec:
        hook = next((name for name in self.env if name in HOOKS), None)
        if hook is not None and not self.rehearsal:
            raise field_error(
                "env",
                f"{hook} is a fault-injection hook for drills and tests (trainer/faults.py): only a run with "
                "rehearsal: true passes it",
            )
        return self

    @model_validator(mode="after")
    def _offload_needs_fsdp(self) -> RunSpec:
        if self.cpu_offload and self.parallel.dp_shard != "fsdp":
            raise field_error(
                "cpu_offload",
                f"needs parallel: fsdp (parallel is {self.parallel.label}); only FSDP shards can live on the CPU",
            )
        return self

    @model_validator(mode="after")
    def _layout_fits_model(self) -> RunSpec:
        parallel, model = self.parallel, self.model
        if model.heads % parallel.tp or model.hidden % parallel.tp:
            raise field_error(
                "parallel.tp",
                f"{parallel.tp} must divide model.heads ({model.heads}) and model.hidden ({model.hidden}): "
                "each tensor-parallel rank takes whole attention heads",
            )
        if model.seq_len % parallel.tp:
            raise field_error(
                "parallel.tp",
                f"{parallel.tp} must divide model.seq_len ({model.seq_len}): sequence parallel splits each "
                "sample's tokens over the tensor-parallel ranks",
            )
        if model.layers % parallel.stages:
            raise field_error(
                "parallel.pp",
                f"{parallel.stages} stage(s) ({parallel.pp_schedule}) must split model.layers ({model.layers}) evenly",
            )
        if self.micro_batch is not None and parallel.pp > 1:
            raise field_error(
                "micro_batch",
                f"cannot be set with pipeline stages (parallel.pp: {parallel.pp}): set parallel.microbatches, "
                "which splits each rank's share of the batch into the pipeline's micro-batches",
            )
        if isinstance(parallel.dp, int) and self.batch_size < parallel.dp:
            raise field_error(
                "batch_size", f"{self.batch_size} is smaller than parallel.dp ({parallel.dp}): a replica would idle"
            )
        return self

    @model_validator(mode="after")
    def _profile_within_steps(self) -> RunSpec:
        window = self.profile.window
        if window is not None and window[1] > self.steps:
            raise field_error("profile.steps", f"{self.profile.steps} ends after the run's last step ({self.steps})")
        return self

    @field_validator("lr", mode="before")
    @classmethod
    def _yaml_float(cls, value: object) -> object:
        # YAML 1.1 reads "3e-3" as a string; accept it as the number the user meant.
        if isinstance(value, str) and re.fullmatch(r"[0-9.]+[eE][-+]?[0-9]+", value):
            return float(value)
        return value


def load_run(path: Path) -> RunSpec:
    return load(path, RunSpec, "run")


def load_run_json(path: Path) -> RunSpec:
    """A resolved run spec as the launcher hands it to the trainers (``RunSpec.model_dump_json()``)."""
    return validate(RunSpec, read_text(path, "run"), path)


def derive_run(source: RunSpec, run_file: Path, *, suffix: str, **changes: Any) -> RunSpec:
    """A run made from ``source`` for a measurement (``plan --measure``, ``bench``): named
    ``<source name><suffix>`` (the name shortened to fit), with ``changes`` to its top-level
    fields, and validated like run.yaml (a change that breaks it names ``run_file`` and the field)."""
    name = source.name[: 40 - len(suffix)].rstrip("-") + suffix
    return validate(RunSpec, source.model_dump(mode="json") | {"name": name, **changes}, run_file)

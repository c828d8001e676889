"""The training engine: one ``Trainer`` per rank builds the model, data, optimizer and
checkpointer from a ``RunSpec``, resumes from the newest committed checkpoint, and trains.

The hot path does not synchronize with the device: steps are queued one after the other, and
every ``log_every`` steps (and on checkpoint steps and the last step) one small all-reduce reads
their losses back together with the flags the ranks must agree on (trainer/steplog.py): whether
a rank got a preemption notice (then every rank saves that step, waits for the commit and
exits; see ``Preempted``), and, on checkpoint steps, whether a rank's previous save is still
running after a short wait (then the scheduled save is skipped: training does not wait long
for a slow or unreachable store; see trainer/saves.py). A preemption notice is therefore acted
on within ``log_every`` steps.

Profiling (run.yaml's ``profile.steps``, ``infractl profile``) costs the loop one integer
compare per step outside the steps it traces; trainer/profiling.py does the rest.

Fault injection (a drill's hook, trainer/faults.py): ``corrupt_weights_at_step`` multiplies every
weight by ``CORRUPT_FACTOR`` on every rank right after that step's update, as a bad update does:
the loss jumps from the next step on and the checkpoints after it hold the bad weights, which a
rollback sets aside (runbooks/rollback.md).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from infractl.config import RunSpec
from infractl.dataset import open_dataset, version_mismatch
from infractl.log import get_logger
from infractl.runstore import Manifest, SaveReason, StepRecord
from infractl.store import Store
from trainer.checkpoint import Checkpointer
from trainer.data import ByteBatches, ValidationBatches
from trainer.distributed import DistEnv
from trainer.errors import RunRefused
from trainer.faults import CORRUPT_FACTOR, CORRUPT_WEIGHTS_ENV, NO_FAULTS, Faults
from trainer.fingerprint import environment_fingerprint
from trainer.held import EmulatedDevice
from trainer.mesh import Layout
from trainer.metrics import CommTimer, MetricsWriter, StepClock
from trainer.model import GPT, GPTConfig, token_loss
from trainer.optimizer import build_optimizer, build_scheduler
from trainer.parallelize import Parallel, compute_dtype, parallelize
from trainer.preemption import PreemptionNotice
from trainer.profiling import StepProfiler
from trainer.replicas import Replicas
from trainer.saves import Saves
from trainer.stateful import (
    ModelState,
    RNGState,
    TrainState,
    make_deterministic,
    optimizer_state,
    rng_key,
    seed_everything,
)
from trainer.steplog import PendingStep, StepLog
from trainer.watchdog import CollectiveTimeout, StepWatchdog

__all__ = ["GRAD_CLIP", "Preempted", "Trainer", "config_hash"]

log = get_logger(__name__)

GRAD_CLIP = 1.0


def config_hash(spec: RunSpec) -> str:
    """Hash of the fields that decide what the weights become.

    ``steps``, ``checkpoint``, ``nodes``, ``parallel`` and ``max_restarts`` are left out: a
    run may be extended, re-cadenced, moved to other nodes or another layout and still be the
    same run.
    """
    fields = spec.model_dump(
        mode="json",
        include={"model", "data", "batch_size", "lr", "seed", "mixed_precision"},
    )
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


class Preempted(Exception):
    """Training stopped at ``step`` because a rank got a preemption notice; ``step`` is
    committed. ``signalled``: whether this rank got it (else a peer did)."""

    def __init__(self, step: int, *, signalled: bool) -> None:
        super().__init__(f"preempted at step {step}")
        self.step = step
        self.signalled = signalled


class Trainer:
    """Trains one run on this rank. Construct and ``train()`` on every rank of the job."""

    def __init__(
        self,
        spec: RunSpec,
        *,
        store: Store,
        run_id: str,
        workdir: Path,
        env: DistEnv,
        device: torch.device,
        faults: Faults = NO_FAULTS,
    ) -> None:
        # A restart's timeline (runstore's StepRecord): built right after the group formed.
        self.timeline = {"started": psutil.Process().create_time(), "joined": time.time()}
        self.spec, self.env, self.device, self.faults = spec, env, device, faults
        self.preemption = PreemptionNotice()
        self.watchdog = StepWatchdog.from_environ(spec.watchdog.step_timeout_s)
        self.collective_timeout = CollectiveTimeout.for_default_group(spec.watchdog, report=self._report_timeout)
        self._warm_from = spec.steps  # the step after which collectives time out: set once warmed up
        self._staging_seen = False  # whether a save or replica of this start was staged and timed
        self.config_hash = config_hash(spec)
        self.fingerprint = environment_fingerprint(world_size=env.world_size)
        (log.info if env.rank == 0 else log.debug)("environment", **self.fingerprint)  # job-wide: train.py's doc
        self.layout = Layout.of(spec, env)
        self.dataset_version, self.data, self.validation = _build_data(spec, self.layout)
        self.parallel = _build_model(spec, env, self.layout, device)
        self.model = self.parallel.module
        self.optimizer = build_optimizer(self.model, lr=spec.lr, shard_state=spec.parallel.dp_shard == "zero1")
        # A CPU rank may rehearse a device's memory limit (trainer/held.py).
        self.emulated = EmulatedDevice.from_environ(self.model, self.optimizer, spec, self.layout, device)
        self.progress = TrainState(scheduler=build_scheduler(self.optimizer, total_steps=spec.steps))
        self.checkpointer = Checkpointer(
            store,
            run_id=run_id,
            workdir=workdir,
            rank=env.rank,
            world_size=env.world_size,
            keep=spec.checkpoint.keep,
            upload_delay_s=faults.upload_delay_s,
        )
        self.metrics = (
            MetricsWriter(store, run_id, tensorboard_dir=workdir / "tensorboard" / run_id) if env.rank == 0 else None
        )
        self.replicas = self._join_replicas()
        self.saves = self._saves()
        #: What this process resumed from: "store", "replica", or None (step 0).
        self.resumed_from: str | None = None
        self.profiler = StepProfiler(
            store, run_id, rank=env.rank, device=device, workdir=workdir, window=spec.profile.window
        )
        self.clock = StepClock(device)
        self._bound_checked = False
        self.steplog = StepLog(
            self.clock, device, env=env, layout=self.layout, tokens_per_step=spec.batch_size * spec.model.seq_len
        )
        # ddp and zero1 all-reduce through DDP, whose comm hook can time it; fsdp cannot.
        self.comm: CommTimer | None = None
        if isinstance(self.model, DistributedDataParallel):
            self.comm = CommTimer(self.clock)
            self.comm.attach(self.model)

    def _saves(self) -> Saves:
        spec = self.spec
        return Saves(
            self.checkpointer,
            self.metrics,
            every=spec.checkpoint.every,
            step_timeout_s=spec.watchdog.step_timeout_s,
            rank=self.env.rank,
            state=lambda: self._state(None),
            extra=self._extra,
            replicas=self.replicas,
            replicate_every=spec.checkpoint.replicate_every,
        )

    def _join_replicas(self) -> Replicas | None:
        """This job's in-memory replicas (collective), unless the run asks for none."""
        if not self.spec.checkpoint.replicate_every:
            return None
        metrics = self.metrics
        records = metrics.unwritten if metrics is not None else list
        return Replicas.join(rank=self.env.rank, world_size=self.env.world_size, records=records)

    def _state(self, loading: Manifest | None) -> dict[str, Any]:
        state: dict[str, Any] = {
            "model": ModelState(self.model),
            "optimizer": optimizer_state(self.model, self.optimizer),
            "progress": self.progress,
        }
        # RNG states are per rank: they only mean something on the same topology.
        if loading is None or loading.world_size == self.env.world_size:
            state[rng_key(self.env.rank)] = RNGState()
        return state

    def resume(self) -> int:
        """Load the newest committed checkpoint, if any; return the last step already done."""
        manifest = self.checkpointer.load(self._state, self.replicas)
        # Every rank says where it starts from; what holds for the whole job, rank 0 says.
        if manifest is None:
            log.info("starting", step=0, world_size=self.env.world_size, attempt=self.env.attempt)
            return 0
        self.resumed_from = "replica" if manifest.reason is SaveReason.REPLICA else "store"
        log.info(
            "resumed",
            step=self.progress.step,
            source=self.resumed_from,
            world_size=self.env.world_size,
            saved_world_size=manifest.world_size,
            saved_reason=manifest.extra.get("reason"),
            attempt=self.env.attempt,
            restart_count=self.env.restart_count,
        )
        if self.metrics is not None:
            # The records the replica's rank 0 had not written yet: the store gets them now.
            for record in manifest.extra.get("records", []):
                if record["step"] <= manifest.step:
                    self.metrics.add(record)
        if manifest.world_size != self.env.world_size and self.env.rank == 0:
            log.info(
                "rng_not_restored",
                reason="world size changed",
                saved_world_size=manifest.world_size,
            )
        if manifest.extra.get("config_hash") != self.config_hash and self.env.rank == 0:
            log.warning("config_changed", saved=manifest.extra.get("config_hash"), now=self.config_hash)
        changed = version_mismatch(
            self.checkpointer.run_id,
            saved=manifest.extra.get("dataset_version"),
            current=self.dataset_version,
            data=self.spec.data,
        )
        if changed:
            raise RunRefused(
                f"data: {changed}; train it under a new run name, or start over with `infractl train --new`"
            )
        return self.progress.step

    def train(self) -> int:
        """Resume, train until ``spec.steps``, checkpoint on schedule; return the last step.

        Raises ``Preempted`` once the step at which any rank got a preemption notice is
        committed. Until the loop starts, SIGTERM ends the process at once: there is nothing
        new to save, and the agent (restarting its workers, say) need not wait its grace.
        """
        self.resume()
        self.timeline["loaded"] = time.time()
        self.preemption.install()  # from the main thread: torchrun's worker runs us there
        self.profiler.start(first_step=self.progress.step + 1)
        spec = self.spec
        first = True
        after_save = False  # see CollectiveTimeout
        while self.progress.step < spec.steps:
            began = time.monotonic()
            step = self.progress.step + 1
            final = step == spec.steps
            preempted = 0
            if step >= self.profiler.due:  # all that profiling costs a step outside its windows
                self.profiler.at(step)
            # Under the watchdog (once started): the step and whatever else must not block,
            # but never a wait for a commit, which depends on the store (see Checkpointer).
            self.preemption.step = step
            with self.watchdog.step(), self.collective_timeout.relaxed(after_save):
                self.steplog.add(self._train_step(step, first=first))
                self.progress.step = step
                self.progress.tokens_seen += spec.batch_size * spec.model.seq_len
                if self.validation is not None and (step % spec.eval.every == 0 or final):
                    self.steplog.last.val_loss = self._evaluate(self.validation)
                if self._log_step(step, final):
                    record, preempted = self._flush(step, final)
            # The step after this start's first save or replica waits for its unknown staging.
            after_save = self._save_due(step) and not self._staging_seen
            if first:
                self._warmed_up()
                first = False
            elif spec.min_step_s and not final:
                # Outside the watchdog's step: the wait is the run's pace, not a step that hangs.
                time.sleep(max(0.0, began + spec.min_step_s - time.monotonic()))
            if final:
                self.profiler.finish()  # the trace ends before the final checkpoint's wait for its commit
                self.saves.final(step, record)
            elif preempted:
                self._stop_preempted(step, record, ranks_signalled=preempted)
        self.saves.close()
        self.profiler.close()
        if self.env.rank == 0:  # every rank's own last line is trainer/train.py's ``stopped``
            log.info("finished", step=self.progress.step, tokens_seen=self.progress.tokens_seen)
        return self.progress.step

    def _flush(self, step: int, final: bool) -> tuple[StepRecord, int]:
        """A log step: read the pending steps back with the flags the ranks agree on, record
        them, and save or replicate ``step`` when due (not the last: ``Saves.final``); return
        its record and how many ranks got a preemption notice."""
        busy = 0.0 if final else float(self.saves.busy(step))
        copying = 0.0 if final else float(self.saves.replicating(step))
        flags = [float(self.preemption.signalled), busy, copying]
        with self.collective_timeout.relaxed():  # a rank may have waited for its previous save
            records, (preempted, saving, replicating) = self.steplog.flush(flags)
        for earlier in records[:-1]:
            self.saves.record(earlier)
        self._check_preemption_bound(records)
        staging_s = 0.0
        if not final:
            started = time.perf_counter()
            self.saves.after_step(
                step, records[-1], preempted=preempted > 0, ranks_saving=saving, ranks_replicating=replicating
            )
            staging_s = time.perf_counter() - started
            self._staging_seen |= self._save_due(step)
        # A step's pace is its own time and what this rank staged after it (the next step's
        # collectives wait for the slowest rank's staging); not the first step of this start.
        paces = [r["step_time_s"] for r in records if r["step"] > self._warm_from]
        if paces:  # the newest record, step's, is among them
            paces[-1] += staging_s
        self.collective_timeout.observe(paces)
        return records[-1], preempted

    def _save_due(self, step: int) -> bool:
        return step % self.spec.checkpoint.every == 0 or self.saves.replica_due(step)

    def _check_preemption_bound(self, records: list[StepRecord]) -> None:
        """Once, after the first steps: warn if ``log_every`` steps take long enough that a
        preemption notice, acted on at the next log step, could miss its grace period."""
        if self._bound_checked or len(records) < 2:
            return
        self._bound_checked = True
        step_s = max(sorted(r["step_time_s"] for r in records)[len(records) // 2], self.spec.min_step_s)
        bound_s = self.spec.log_every * step_s
        if bound_s > self.spec.preemption.grace_s / 2 and self.env.rank == 0:
            log.warning(
                "preemption_bound",
                log_every=self.spec.log_every,
                step_s=step_s,
                notice_to_save_s=round(bound_s, 1),
                grace_s=self.spec.preemption.grace_s,
                advice="lower log_every or raise preemption.grace_s",
            )

    def _log_step(self, step: int, final: bool) -> bool:
        """Whether ``step`` reads the pending steps back (see trainer/steplog.py): every
        log_every steps, on checkpoint and replica steps, at the last step. (A replica carries
        the metrics records of the steps before it: they must exist.)"""
        spec = self.spec
        return final or step % spec.log_every == 0 or step % spec.checkpoint.every == 0 or self.saves.replica_due(step)

    def _warmed_up(self) -> None:
        """After the first step of this process (loading and the first step may be slow): from
        now on a step must finish within ``watchdog.step_timeout_s``, and every collective on
        the default group within half of it, then within what the steps seen allow
        (``CollectiveTimeout``).

        At most half: a rank waiting in a collective for a hung peer is not hung itself. Its
        collective fails before its own deadline, it exits with an error and its agent
        restarts the workers (see trainer/watchdog.py). With equal timeouts the deadlines of
        the waiting ranks, armed before their collective began, would expire first, and every
        node's agent would be killed with its reaped worker. Either way survivors fail within
        the step timeout instead of the backend's default (30 minutes on gloo).
        """
        timeout_s = self.spec.watchdog.step_timeout_s
        self._warm_from = self.progress.step
        self.collective_timeout.start()
        self.watchdog.start()
        if self.env.rank == 0:
            log.info("watchdog_started", step_timeout_s=timeout_s, file_timer=self.watchdog.enabled)

    def _report_timeout(self, seconds: float, slowest_step_s: float) -> None:
        if self.env.rank == 0:
            log.info("collective_timeout", timeout_s=seconds, slowest_step_s=round(slowest_step_s, 3))

    def _stop_preempted(self, step: int, record: StepRecord, *, ranks_signalled: int) -> None:
        """A rank got a preemption notice: commit ``step`` and stop (``Preempted``)."""
        self.saves.preempted(step, record)
        signalled = self.preemption.signalled
        # Rank 0 speaks for the job; the others' lines are there for their own logs.
        report = log.warning if self.env.rank == 0 else log.info
        report(
            "preempted",
            step=step,
            signalled=signalled,
            noticed_at_step=self.preemption.noticed_at_step,
            ranks_signalled=ranks_signalled,
        )
        raise Preempted(step, signalled=signalled)

    def _train_step(self, step: int, *, first: bool) -> PendingStep:
        """One optimizer step, queued and not read back: its loss and gradient norm stay on the
        device, its time marks are taken as it goes (see trainer/steplog.py)."""
        clock = self.clock
        if self.comm is not None:
            self.comm.reset()
        start = clock.mark()
        inputs, targets = (t.to(self.device, non_blocking=True) for t in self.data.batch(step))
        fetched = clock.mark()
        self.optimizer.zero_grad(set_to_none=True)
        with self.emulated.watching() if self.emulated is not None else contextlib.nullcontext():
            loss = self._forward_backward(inputs, targets)
        backward_done = clock.mark()
        norm = self.parallel.reduce_and_clip(GRAD_CLIP)
        self.optimizer.step()
        self.progress.scheduler.step()
        if self.faults.corrupt_weights_at_step == step:
            self._corrupt_weights(step)
        stepped = clock.mark()
        return PendingStep(
            step=step,
            loss=loss.detach(),
            grad_norm=norm.detach(),
            marks=(start, fetched, backward_done, stepped),
            comm=self.comm.window() if self.comm is not None else None,
            time=time.time(),
            environment=dict(self.fingerprint) if first else None,
            timeline=dict(self.timeline) if first else None,
            resumed_from=self.resumed_from if first else None,
        )

    def _corrupt_weights(self, step: int) -> None:
        """The injected bad update (the module docstring)."""
        log.warning("weights_corrupted", step=step, factor=CORRUPT_FACTOR, injected_by=CORRUPT_WEIGHTS_ENV)
        with torch.no_grad():
            for p in self.model.parameters():
                p.mul_(CORRUPT_FACTOR)

    def _forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Gradients of this rank's share of the global batch; returns its part of the global
        mean loss (the step log sums the parts of all ranks and divides by the world size).

        Each pass's mean loss is weighted by its samples' share of the global batch times the
        data-parallel degree, because DDP and FSDP average the gradients over the
        data-parallel ranks: the result is the global batch's mean for any split. Only the last
        pass synchronizes the gradients. A pass can be empty (one sample per pass, and this rank
        has one sample fewer than its peers): it still runs, so the ranks' collectives match.
        """
        pipeline = self.parallel.pipeline
        if pipeline is not None:
            with self._autocast():
                return pipeline.step(inputs, targets)
        layout = self.layout
        passes = layout.passes()
        total: torch.Tensor | None = None
        offset = 0
        for index, size in enumerate(passes):
            with self._gradient_sync(index == len(passes) - 1), self._autocast():
                logits = self.model(inputs[offset : offset + size])
                weight = size * layout.dp / layout.batch_size
                loss = token_loss(logits, targets[offset : offset + size]) if size else logits.sum() * 0.0
                if weight not in (0.0, 1.0):
                    loss = loss * weight
                loss.backward()
            offset += size
            total = loss.detach() if total is None else total + loss.detach()
        assert total is not None
        return total

    def _gradient_sync(self, last: bool) -> contextlib.AbstractContextManager[object]:
        """Around one pass of several: DDP and FSDP reduce the gradients in the last pass only."""
        if last:
            return contextlib.nullcontext()
        if isinstance(self.model, DistributedDataParallel):
            return self.model.no_sync()
        if isinstance(self.model, FSDPModule):
            self.model.set_requires_gradient_sync(False)
            return _RestoreSync(self.model)
        return contextlib.nullcontext()

    @torch.no_grad()
    def _evaluate(self, batches: ValidationBatches) -> float:
        """Mean loss over the fixed validation batches, all ranks together (collective). Each
        rank's share is weighted by its size; only one rank of each model copy (the first
        tensor-parallel rank of the last stage) contributes it."""
        layout = self.layout
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for inputs, targets in batches:
            inputs, targets = inputs.to(self.device), targets.to(self.device)
            if self.parallel.pipeline is not None:
                with self._autocast():
                    loss = self.parallel.pipeline.evaluate(inputs, targets) / layout.pp
            else:
                with self._autocast():
                    loss = token_loss(self.model(inputs), targets)
            if layout.tp_rank == 0:
                total += loss.double() * (len(inputs) / layout.batch_size)
        dist.all_reduce(total)
        return float(total.item()) / len(batches)

    def _autocast(self) -> contextlib.AbstractContextManager[object]:
        """The forward's compute dtype, the same way for every scheme (fsdp also gathers its
        weights in it; see ``parallelize``)."""
        if self.spec.mixed_precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=compute_dtype(self.spec.mixed_precision))

    def _extra(self, reason: SaveReason) -> dict[str, Any]:
        """What a checkpoint's manifest records besides the files."""
        return {
            "reason": reason,
            "tokens_seen": self.progress.tokens_seen,
            "config_hash": self.config_hash,
            "dataset_version": self.dataset_version,
            "environment": self.fingerprint,
            # The checkpoint describes itself: `infractl export` builds the model from these.
            "model": self.spec.model.model_dump(mode="json"),
            "parallel": self.spec.parallel.label,
        }


class _RestoreSync(contextlib.AbstractContextManager[object]):
    """Turns FSDP's gradient reduction back on after a pass that accumulated without it."""

    def __init__(self, module: FSDPModule) -> None:
        self.module = module

    def __exit__(self, *exc: object) -> None:
        self.module.set_requires_gradient_sync(True)


def _build_data(spec: RunSpec, layout: Layout) -> tuple[str, ByteBatches, ValidationBatches | None]:
    """The dataset's version, this rank's training batches, and its validation batches (when
    the run evaluates). Ranks of one model copy (tensor and pipeline parallel) share their
    data-parallel rank's batches."""
    dataset = open_dataset(spec.data)
    data = ByteBatches(
        dataset.tokens("train"),
        seq_len=spec.model.seq_len,
        batch_size=spec.batch_size,
        seed=spec.seed,
        rank=layout.dp_rank,
        world_size=layout.dp,
    )
    validation = None
    if spec.eval.every:
        validation = ValidationBatches(
            dataset.tokens("val"),
            seq_len=spec.model.seq_len,
            batch_size=spec.batch_size,
            batches=spec.eval.batches,
            rank=layout.dp_rank,
            world_size=layout.dp,
        )
    return dataset.version, data, validation


def _build_model(spec: RunSpec, env: DistEnv, layout: Layout, device: torch.device) -> Parallel:
    """The model, parallelized by the run's layout: built on the meta device, so a rank
    allocates and initialises only what it holds (trainer/parallelize.py)."""
    if spec.deterministic:
        make_deterministic()
    # The initial weights come from spec.seed and each parameter's name (trainer/model.py);
    # anything random during training from a per-rank seed (a resume restores these states).
    seed_everything(spec.seed + env.rank)
    with torch.device("meta"):
        model = GPT(GPTConfig.from_spec(spec.model))
    return parallelize(model, spec=spec, layout=layout, device=device)

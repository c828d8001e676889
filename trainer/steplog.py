"""The steps between log steps, kept on the device until a log step reads them all at once.

A step's loss and gradient norm are tensors on the device; reading one back to the host
(``.item()``) waits for the device to finish everything queued so far, which on a GPU stops the
host from queuing the next step while it waits. So each step is kept as it was queued (its
tensors, and its time marks: CUDA events, or host seconds on the CPU), and every
``log_every`` steps, on checkpoint steps and at the last step, ``flush`` turns them into metrics
records with one small all-reduce (the losses, and the flags the ranks must agree on: a
preemption notice, a save still running) and one read back to the host.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from infractl.runstore import StepRecord
from trainer.distributed import DistEnv
from trainer.mesh import Layout
from trainer.metrics import Mark, StepClock, peak_memory_bytes

__all__ = ["PendingStep", "StepLog"]


@dataclass
class PendingStep:
    """A step trained and not read back yet."""

    step: int
    loss: torch.Tensor  # this rank's loss, a 0-dim tensor on the device
    grad_norm: torch.Tensor  # the global gradient norm before clipping, on the device
    marks: tuple[Mark, Mark, Mark, Mark]  # started, batch fetched, backward done, optimizer stepped
    comm: tuple[Mark, Mark] | None  # DDP's gradient all-reduce window (None for fsdp)
    time: float  # host clock when the step was queued
    val_loss: float | None = None
    environment: dict[str, Any] | None = None  # in the first step of the process
    timeline: dict[str, float] | None = None  # likewise: when the process started, joined, loaded
    resumed_from: str | None = None  # likewise: "store" or "replica", None at step 0


class StepLog:
    """Buffers one rank's pending steps; ``flush`` reads them back (a collective: every rank
    flushes on the same steps)."""

    def __init__(
        self,
        clock: StepClock,
        device: torch.device,
        *,
        env: DistEnv,
        layout: Layout,
        tokens_per_step: int,
    ) -> None:
        self.clock = clock
        self.device = device
        self.world_size = env.world_size
        self.attempt = env.attempt
        self.restart_count = env.restart_count
        self.tokens_per_step = tokens_per_step
        self.micro_batch = layout.micro_batch
        self.accumulation = layout.accumulation
        self.pending: list[PendingStep] = []

    def add(self, step: PendingStep) -> None:
        self.pending.append(step)

    @property
    def last(self) -> PendingStep:
        return self.pending[-1]

    def flush(self, flags: list[float]) -> tuple[list[StepRecord], list[int]]:
        """Records of every pending step, oldest first, and each of ``flags`` summed over the
        ranks (how many ranks raised it). One all-reduce, one read back to the host."""
        steps, self.pending = self.pending, []
        losses = torch.stack([p.loss.detach().float().reshape(()) for p in steps])
        started = time.perf_counter()
        summed = torch.cat([losses, torch.tensor(flags, dtype=torch.float32, device=self.device)])
        dist.all_reduce(summed)
        # The gradient norms are already global (the same on every rank): read, not reduced.
        norms = torch.stack([p.grad_norm.detach().float().reshape(()) for p in steps])
        values = torch.cat([summed, norms]).tolist()
        read_s = time.perf_counter() - started
        count = len(steps)
        raised = [round(v) for v in values[count : count + len(flags)]]
        peak = peak_memory_bytes(self.device)
        records = []
        for i, pending in enumerate(steps):
            step_s = self.clock.seconds(pending.marks[0], pending.marks[3])
            if not self.clock.cuda and i == count - 1:
                step_s += read_s  # on the CPU the host waits here; on CUDA the events hold the device's time
            record = StepRecord(
                step=pending.step,
                # The global batch's loss, not this rank's share of it.
                loss=values[i] / self.world_size,
                step_time_s=round(step_s, 6),
                tokens_per_s=round(self.tokens_per_step / step_s, 1),
                world_size=self.world_size,
                attempt=self.attempt,
                restart_count=self.restart_count,
                time=pending.time,
                data_s=round(self.clock.seconds(pending.marks[0], pending.marks[1]), 6),
                forward_backward_s=round(self.clock.seconds(pending.marks[1], pending.marks[2]), 6),
                optimizer_s=round(self.clock.seconds(pending.marks[2], pending.marks[3]), 6),
                comm_s=round(max(self.clock.seconds(*pending.comm), 0.0), 6) if pending.comm else None,
                checkpoint_blocking_s=0.0,
                peak_memory_bytes=peak,
                grad_norm=values[count + len(flags) + i],
                micro_batch=self.micro_batch,
                accumulation=self.accumulation,
            )
            if pending.val_loss is not None:
                record["val_loss"] = pending.val_loss
            if pending.environment is not None:
                record["environment"] = pending.environment
            if pending.timeline is not None:
                record["timeline"] = pending.timeline
            if pending.resumed_from is not None:
                record["resumed_from"] = pending.resumed_from
            records.append(record)
        return records, raised

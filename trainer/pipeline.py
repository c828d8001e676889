"""Pipeline parallel: this rank's stages of the model, run by a ``torch.distributed.pipelining``
schedule over the mesh's ``pp`` group.

Each pipeline step splits the rank's share of the batch into ``parallel.microbatches`` equal
micro-batches: ``gpipe`` runs all their forwards, then all their backwards; ``1f1b`` starts
backwards as soon as the last stage has a loss, so a stage holds at most ``pp`` micro-batches'
activations; ``interleaved-1f1b`` gives each rank two stages, round-robin (rank ``r`` runs
stages ``r`` and ``r + pp``), so a rank waits less for its neighbours. The first stage feeds
the tokens, the last stage computes each micro-batch's loss (the mean over its tokens; the
schedule divides the gradients by the number of micro-batches, so they are the mean over the
rank's share).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.pipelining.schedules import _PipelineSchedule
from torch.distributed.pipelining.stage import _PipelineStageBase

from infractl.config import ParallelSpec
from trainer.mesh import Layout
from trainer.model import token_loss

__all__ = ["Pipeline"]

_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


class Pipeline:
    """Runs training and evaluation steps through this rank's stage."""

    def __init__(
        self,
        stages: Sequence[nn.Module],
        *,
        parallel: ParallelSpec,
        layout: Layout,
        mesh: DeviceMesh,
        device: torch.device,
    ) -> None:
        self.layout = layout
        self.first = layout.pp_rank == 0
        self.last = layout.pp_rank == layout.pp - 1
        self.device = device
        group = mesh["pp"].get_group()
        pipeline_stages: list[_PipelineStageBase] = [
            PipelineStage(stage, index, layout.stages, device, group=group)
            for stage, index in zip(stages, layout.stage_indices, strict=True)
        ]
        micro = parallel.n_microbatches
        self.schedule: _PipelineSchedule
        if parallel.pp_schedule == "interleaved-1f1b":
            self.schedule = ScheduleInterleaved1F1B(pipeline_stages, micro, loss_fn=token_loss, scale_grads=True)
        else:
            [stage] = pipeline_stages
            self.schedule = _SCHEDULES[parallel.pp_schedule](stage, micro, loss_fn=token_loss, scale_grads=True)

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward and backward over ``inputs``; this rank's part of the global mean loss (see
        ``_reported``)."""
        return self._run(self.schedule.step, inputs, targets)

    @torch.no_grad()
    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self._run(self.schedule.eval, inputs, targets)

    def _run(self, run: object, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.first else ()
        run(*args, target=targets if self.last else None, losses=losses if self.last else None)  # type: ignore[operator]
        return self._reported(losses)

    def _reported(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """The loss as the step log sums it over every rank: only the last stage has it, so it
        counts ``pp`` times there and not at all on the other stages."""
        if not self.last:
            return torch.zeros((), device=self.device)
        return torch.stack([loss.detach() for loss in losses]).mean() * self.layout.pp

"""Where a rank sits in the run's mesh, and which part of each global batch it trains on.

The mesh is ``(pp, dp, tp)``, row-major over the global ranks: the ``tp`` ranks of one model
copy are neighbours (on one node when a node runs ``tp`` or more ranks), the ``pp`` stages are
the slowest-varying dimension. Every rank of a ``(pp, tp)`` group trains on the same samples:
data is split over ``dp`` only.

The global batch stays ``batch_size`` at every world size. Data-parallel rank ``d`` takes a
contiguous share of it (``split_batch``: uneven when ``dp`` does not divide it), trained as
``accumulation`` forward/backward passes of at most ``micro_batch`` samples each. The
micro-batch is sized for the largest world the run may have (``nodes.max``), where one pass
takes the whole share; on fewer ranks a share is larger and takes more passes, so memory per
pass stays what the full world needed. Each pass's loss is weighted by its share of the
global batch, so the gradient is the global batch's mean whatever the split. A pipeline
(``pp`` > 1) splits each share into its own ``parallel.microbatches`` and needs them equal;
the launcher checks that (``infractl.config.check_layout``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from infractl.config import RunSpec, micro_batch, split_batch
from trainer.distributed import DistEnv

__all__ = ["Layout"]


@dataclass(frozen=True)
class Layout:
    """This rank's coordinates in the mesh and its part of every global batch."""

    world_size: int
    dp: int
    tp: int
    pp: int
    dp_rank: int
    tp_rank: int
    pp_rank: int
    batch_size: int
    """The global batch, samples per optimizer step."""
    share: int
    """Samples this rank trains on per optimizer step (its data-parallel group's share)."""
    stages: int
    """Pipeline stages: pp, or 2 x pp when each pipeline rank runs two (interleaved-1f1b)."""
    micro_batch: int
    """Largest forward/backward pass, in samples (a pipeline's micro-batch when pp > 1)."""
    accumulation: int
    """Forward/backward passes per optimizer step (1 with a pipeline: it has micro-batches)."""

    @classmethod
    def of(cls, spec: RunSpec, env: DistEnv) -> Layout:
        """The layout of ``env.rank`` in its world; the micro-batch is sized for the largest
        world, ``nodes.max`` nodes of this node's ranks. The layout must fit the world
        (``infractl.config.check_layout``)."""
        parallel = spec.parallel
        rank, world_size = env.rank, env.world_size
        max_world_size = spec.nodes.max * env.local_world_size
        dp = parallel.dp_degree(world_size)
        pp_rank, rest = divmod(rank, dp * parallel.tp)
        dp_rank, tp_rank = divmod(rest, parallel.tp)
        shares = split_batch(spec.batch_size, dp)
        largest = micro_batch(spec, world_size=world_size, max_world_size=max_world_size)
        accumulation = 1 if parallel.pp > 1 else math.ceil(shares[0] / largest)
        return cls(
            world_size=world_size,
            dp=dp,
            tp=parallel.tp,
            pp=parallel.pp,
            dp_rank=dp_rank,
            tp_rank=tp_rank,
            pp_rank=pp_rank,
            stages=parallel.stages,
            batch_size=spec.batch_size,
            share=shares[dp_rank],
            micro_batch=largest,
            accumulation=accumulation,
        )

    @property
    def meshed(self) -> bool:
        """Whether the run needs a device mesh (tensor or pipeline parallel); data parallel
        alone runs on the default process group."""
        return self.tp > 1 or self.pp > 1

    @property
    def stage_indices(self) -> list[int]:
        """The pipeline stages this rank runs: ``pp_rank``, and ``pp_rank + pp`` when it runs
        two (the round-robin of interleaved-1f1b). The first stage is always on pipeline rank
        0, the last on pipeline rank pp - 1."""
        return list(range(self.pp_rank, self.stages, self.pp))

    def passes(self) -> list[int]:
        """Samples in each forward/backward pass of this rank's share, in order: as even as
        can be (a pass may be empty on a rank with one sample fewer than its peers)."""
        return split_batch(self.share, self.accumulation)

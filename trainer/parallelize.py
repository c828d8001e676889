"""How the model is spread over ranks. One entry point, ``parallelize``, for every scheme:

- ``ddp``: every rank holds the whole model and optimizer; gradients are all-reduced.
- ``zero1``: DDP, and AdamW's state sharded over the ranks (see ``optimizer.build_optimizer``).
- ``fsdp``: FSDP2 ``fully_shard`` on each transformer block and at the root: weights,
  gradients and optimizer state are DTensors sharded over the ranks.

A world of one rank goes through the same path: parallel degree 1 is a normal mode.
"""

from __future__ import annotations

import functools
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable.checkpoint_activation import checkpoint
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.nn.parallel import DistributedDataParallel

from trainer.model import GPT

__all__ = ["Scheme", "Precision", "SCHEMES", "parallelize", "compute_dtype"]

Scheme = Literal["ddp", "zero1", "fsdp"]
Precision = Literal["fp32", "bf16"]
SCHEMES: tuple[Scheme, ...] = ("ddp", "zero1", "fsdp")


def compute_dtype(precision: Precision) -> torch.dtype:
    return torch.bfloat16 if precision == "bf16" else torch.float32


def parallelize(
    model: GPT,
    *,
    scheme: Scheme,
    device: torch.device,
    activation_checkpointing: bool = False,
    mixed_precision: Precision = "fp32",
    cpu_offload: bool = False,
) -> nn.Module:
    """Move ``model`` to ``device`` and apply ``scheme``; the result is what the step calls.

    Mixed precision for ``ddp`` and ``zero1`` is the step's ``torch.autocast`` alone (the
    engine applies it for every scheme); ``fsdp`` also gathers weights in that dtype.
    """
    if scheme not in SCHEMES:
        raise ValueError(f"parallel must be one of: {', '.join(SCHEMES)} (got {scheme!r})")
    if cpu_offload and scheme != "fsdp":
        raise ValueError(f"cpu_offload needs parallel: fsdp (got parallel: {scheme})")
    model = model.to(device)

    # Activation checkpointing before sharding: fully_shard then treats each checkpointed
    # block as one unit, and its hooks gather the block's weights for the recompute in the
    # backward pass as they do for the forward. The composable form adds hooks rather than
    # a wrapper module, so parameter names (and checkpoint keys) do not change with it.
    if activation_checkpointing:
        for block in model.blocks:
            checkpoint(block)

    if scheme in ("ddp", "zero1"):
        # DDP broadcasts rank 0's weights at construction, so ranks start identical
        # even if their seeds were not. zero1 differs only in its optimizer.
        device_ids = [device.index] if device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids)

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    dtype = compute_dtype(mixed_precision)
    # Gradients are reduced in fp32 whatever the compute dtype: a bf16 sum over many ranks
    # loses the small updates that training depends on.
    mp_policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    offload_policy = CPUOffloadPolicy(pin_memory=device.type == "cuda") if cpu_offload else OffloadPolicy()
    shard = functools.partial(fully_shard, mesh=mesh, mp_policy=mp_policy, offload_policy=offload_policy)
    # Blocks first, then the root: each block is its own unit of all-gather and
    # reduce-scatter (communication overlaps the neighbouring block's compute); the root
    # unit takes what is left (embeddings, final norm). Every rank builds identical initial
    # weights from the same seed, and fully_shard keeps each rank's slice of them.
    for block in model.blocks:
        shard(block)
    # The root's weights (the tied embedding) are used again right after the last block,
    # in the output projection: resharding them after forward would only gather them again.
    shard(model, reshard_after_forward=False)
    return model

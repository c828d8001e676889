"""AdamW and its learning-rate schedule: linear warm-up, then cosine decay."""

from __future__ import annotations

import functools
import math

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

__all__ = ["build_optimizer", "build_scheduler", "lr_factor", "warmup_steps"]

_WEIGHT_DECAY = 0.1
_BETAS = (0.9, 0.95)
#: The schedule ends at this fraction of the peak learning rate.
_FINAL_FACTOR = 0.1


def build_optimizer(model: nn.Module, *, lr: float, shard_state: bool = False) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (not biases, norms or embeddings' 1-D params).

    ``shard_state`` (ZeRO-1): a ``ZeroRedundancyOptimizer`` gives each rank the AdamW state of
    a partition of the parameters; after its step each rank broadcasts the parameters it
    updated. For a model whose parameters are already sharded (FSDP), leave it False.
    """
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": _WEIGHT_DECAY},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    # foreach=False: the per-tensor loop is deterministic and fast enough at these sizes.
    if shard_state:
        # Imported here: it costs every process that imports the trainer a third of a second.
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, lr=lr, betas=_BETAS, foreach=False)
    return torch.optim.AdamW(groups, lr=lr, betas=_BETAS, foreach=False)


def warmup_steps(total_steps: int) -> int:
    return max(1, total_steps // 10)


def lr_factor(index: int, *, total_steps: int) -> float:
    """Multiplier of the peak LR for the step with 0-based ``index`` (step ``index + 1``)."""
    warmup = warmup_steps(total_steps)
    if index < warmup:
        return (index + 1) / warmup
    progress = min(1.0, (index - warmup) / max(1, total_steps - warmup))
    return _FINAL_FACTOR + (1 - _FINAL_FACTOR) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, *, total_steps: int) -> LambdaLR:
    """Step it once after every optimizer step."""
    return LambdaLR(optimizer, functools.partial(lr_factor, total_steps=total_steps))

"""How the model is spread over ranks. One entry point, ``parallelize``; one scheme per branch."""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

__all__ = ["Scheme", "parallelize"]

Scheme = Literal["ddp"]


def parallelize(model: nn.Module, *, scheme: Scheme, device: torch.device) -> nn.Module:
    """Move ``model`` to ``device`` and apply ``scheme``; the result is what the step calls.

    A world of one rank goes through the same path: parallel degree 1 is a normal mode.
    """
    model = model.to(device)
    if scheme == "ddp":
        # DDP broadcasts rank 0's weights at construction, so ranks start identical
        # even if their seeds were not.
        device_ids = [device.index] if device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids)
    raise ValueError(f"parallel must be one of: ddp (got {scheme!r})")

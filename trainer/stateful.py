"""What a checkpoint holds, as DCP ``Stateful`` objects: model and optimizer, progress, RNGs."""

from __future__ import annotations

import os
import random
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.nn.parallel import DistributedDataParallel
from torch.optim.lr_scheduler import LRScheduler

if TYPE_CHECKING:
    from torch.distributed.optim import ZeroRedundancyOptimizer

__all__ = [
    "ModelState",
    "OptimizerState",
    "ShardedOptimizerState",
    "optimizer_state",
    "TrainState",
    "RNGState",
    "seed_everything",
    "make_deterministic",
    "rng_key",
]


class ModelState(Stateful):
    """The model's weights, keyed by parameter name (no DDP prefix) so DCP can reshard them."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.model)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state_dict)


#: The optimizer's checkpoint layout: flat keys per parameter name, ``state.<name>.<exp_avg|...>``
#: and ``param_groups.<name>.<lr|betas|...>``. A list of param groups would be one object per
#: rank under one key, and DCP keeps one rank's copy of such a key: with pipeline stages, whose
#: groups hold different parameters, the other stages would load the wrong groups.
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


class OptimizerState(Stateful):
    """The optimizer's moments and step counts, keyed by parameter name (DTensors under FSDP
    and tensor parallel; each pipeline stage its own parameters).

    For every layout but ``zero1``, which has ``ShardedOptimizerState``, in the same layout.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optimizer, options=_FLAT)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state_dict, options=_FLAT)


class ShardedOptimizerState(Stateful):
    """ZeRO-1's optimizer state: each rank contributes the AdamW state of the parameters it owns.

    The layout is ``OptimizerState``'s (``state.<param name>.<exp_avg|...>`` and
    ``param_groups.<param name>.<lr|...>``), so DCP writes each parameter's state once, from the rank that owns it,
    with no gather to rank 0 (``ZeroRedundancyOptimizer.consolidate_state_dict`` would send
    everything there). Loading asks for the parameters this rank owns *now*: DCP reads each
    from whichever rank's file holds it, so a checkpoint saved on any world size, or by
    ``ddp``, re-partitions onto the current one (ZeRO's partition is a pure function of the
    parameter sizes and the world size).

    Re-partitioning is exact because AdamW's state is per parameter; an inner optimizer with
    state shared between parameters would need its own. A parameter not stepped yet is saved
    with zero moments and step 0, which AdamW treats exactly as no state.
    """

    def __init__(self, model: nn.Module, optimizer: ZeroRedundancyOptimizer) -> None:
        self.optimizer = optimizer
        names = {p: name for name, p in _unwrapped(model).named_parameters()}
        # The local optimizer holds only this rank's partition.
        self._owned = [(names[p], p) for group in optimizer.optim.param_groups for p in group["params"]]
        self._groups = [[names[p] for p in group["params"]] for group in optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        local = self.optimizer.optim.state
        out: dict[str, Any] = {}
        for name, p in self._owned:
            for key, value in (dict(local[p]) if local.get(p) else _empty_adam_state(p)).items():
                out[f"state.{name}.{key}"] = value
        for group, names in zip(self.optimizer.param_groups, self._groups, strict=True):
            for name in names:
                out.update({f"param_groups.{name}.{k}": v for k, v in group.items() if k != "params"})
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for name, p in self._owned:
            prefix = f"state.{name}."
            self.optimizer.optim.state[p] = {
                k.removeprefix(prefix): v for k, v in state_dict.items() if k.startswith(prefix)
            }
        # lr and the rest; ZeRO copies them to the local optimizer at its next step.
        for group, names in zip(self.optimizer.param_groups, self._groups, strict=True):
            prefix = f"param_groups.{names[0]}."
            group.update({k.removeprefix(prefix): v for k, v in state_dict.items() if k.startswith(prefix)})


@dataclass
class TrainState(Stateful):
    """Progress: optimizer steps completed, tokens trained on (all ranks), and the LR schedule."""

    scheduler: LRScheduler
    step: int = 0
    tokens_seen: int = 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "scheduler": self.scheduler.state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
        self.tokens_seen = int(state_dict["tokens_seen"])
        self.scheduler.load_state_dict(state_dict["scheduler"])


def rng_key(rank: int) -> str:
    """Checkpoint key of one rank's RNG state: one key per rank, so ranks never collide."""
    return f"rng-rank-{rank}"


class RNGState(Stateful):
    """This process's torch (CPU and CUDA), numpy and python RNG states."""

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "torch": torch.get_rng_state(),
            "numpy": np.random.get_state(),
            "python": random.getstate(),
        }
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        torch.set_rng_state(state_dict["torch"])
        np.random.set_state(state_dict["numpy"])
        random.setstate(state_dict["python"])
        if "cuda" in state_dict and torch.cuda.is_available():
            torch.cuda.set_rng_state(state_dict["cuda"])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def make_deterministic() -> None:
    """Same inputs, same bits: deterministic kernels and a fixed CPU thread count.

    Seeds are fixed by ``seed_everything`` in every mode. The thread count is part of the
    arithmetic on CPU (it decides how a kernel splits its reductions), so it is pinned to one
    rather than left to the machine: a run resumed on another machine computes the same way.
    """
    # cuBLAS reads this when it creates its handle; before the first matmul is early enough.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.set_num_threads(1)


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> Stateful:
    """The checkpoint entry for ``optimizer``: sharded for ZeRO-1, DCP's own helpers otherwise."""
    # build_optimizer imports ZeRO only to build one: unimported, this optimizer is not one.
    zero = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
    if zero is not None and isinstance(optimizer, zero.ZeroRedundancyOptimizer):
        return ShardedOptimizerState(model, optimizer)
    return OptimizerState(model, optimizer)


def _unwrapped(model: nn.Module) -> nn.Module:
    # Parameter names as get_model_state_dict gives them: without DDP's "module." prefix.
    return model.module if isinstance(model, DistributedDataParallel) else model


def _empty_adam_state(param: torch.Tensor) -> dict[str, torch.Tensor]:
    """AdamW's state for ``param`` before its first step: the shapes DCP loads into."""
    return {
        "step": torch.tensor(0.0),
        "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
        "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
    }

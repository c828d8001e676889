"""The process group: where this rank sits (from torchrun's environment), backend and device."""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["DistEnv", "init_process_group", "destroy_process_group", "device_for"]

#: Set by the launcher: which attempt of the run this is (1-based).
ATTEMPT_ENV = "INFRACTL_ATTEMPT"


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the job, read from torchrun's environment."""

    rank: int
    """Global rank, 0 .. world_size - 1."""
    world_size: int
    """Ranks in the job (all nodes)."""
    local_rank: int
    """Rank on this node; picks the accelerator."""
    local_world_size: int
    """Ranks on this node."""
    restart_count: int
    """Times torchrun restarted the workers in this attempt (TORCHELASTIC_RESTART_COUNT)."""
    attempt: int
    """The launcher's attempt number ($INFRACTL_ATTEMPT, 1 when unset)."""

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> DistEnv:
        """Read torchrun's variables; without them, a job of one rank."""
        env = os.environ if environ is None else environ

        def number(name: str, default: int) -> int:
            raw = env.get(name, "")
            try:
                return int(raw) if raw else default
            except ValueError:
                raise ValueError(f"environment variable {name} must be an integer, got {raw!r}") from None

        return cls(
            rank=number("RANK", 0),
            world_size=number("WORLD_SIZE", 1),
            local_rank=number("LOCAL_RANK", 0),
            local_world_size=number("LOCAL_WORLD_SIZE", 1),
            restart_count=number("TORCHELASTIC_RESTART_COUNT", 0),
            attempt=number(ATTEMPT_ENV, 1),
        )


def device_for(env: DistEnv) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", env.local_rank)
    return torch.device("cpu")


def init_process_group(env: DistEnv, *, timeout_s: float = 300.0) -> torch.device:
    """Join the job's process group (nccl on CUDA, gloo on CPU); return this rank's device."""
    device = device_for(env)
    timeout = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if "MASTER_ADDR" in os.environ:
        dist.init_process_group(backend, timeout=timeout, device_id=device if device.type == "cuda" else None)
    else:
        # Started without torchrun: a job of one, rendezvous in memory.
        # torch's stubs do not re-export the c10d store classes from torch.distributed.
        store = dist.HashStore()  # type: ignore[attr-defined]
        dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
    return device


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()

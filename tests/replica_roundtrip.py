"""Under torchrun: a replica of a run's newest committed step, then what it loads into::

    INFRACTL_REPLICA_ADDR=HOST:PORT torchrun --nproc-per-node=N tests/replica_roundtrip.py \\
        --spec SPEC.json --store URI --run-id RUN --workdir DIR --out FILE

Every rank's replicas go to the one replica server named in the environment (the test's: one
node's agent). Every rank builds the run's ``Trainer`` and resumes it as a job does. When the
server holds no replica yet, that resume is from the store's commit, and the ranks save a replica
of that very step. When it holds one, the resume is from the replica; a second ``Trainer``
without replicas then resumes the same step from the store. Rank 0 saves to FILE where it resumed
from and, in the second case, both states: every tensor of the model, the optimizer and the
progress, whole (run it on one rank: the states of another world size are then comparable).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torchrun_script
from torch.distributed.tensor import DTensor

from infractl.config import load_run_json
from infractl.config.run import RunSpec
from infractl.store import open_store
from trainer.distributed import DistEnv
from trainer.engine import Trainer


def _trainer(spec: RunSpec, args: argparse.Namespace, env: DistEnv, device: torch.device, workdir: str) -> Trainer:
    return Trainer(
        spec, store=open_store(args.store), run_id=args.run_id, workdir=args.workdir / workdir, env=env, device=device
    )


def _whole(trainer: Trainer) -> dict[str, Any]:
    """The trainer's model, optimizer and progress as one flat dict of whole values."""
    state = trainer._state(None)
    flat: dict[str, Any] = {}
    for key in ("model", "optimizer", "progress"):
        for name, value in state[key].state_dict().items():
            flat[f"{key}.{name}"] = value.full_tensor() if isinstance(value, DTensor) else value
    return flat


def _roundtrip(args: argparse.Namespace, env: DistEnv, device: torch.device) -> None:
    spec = load_run_json(args.spec)
    trainer = _trainer(spec, args, env, device, "with-replicas")
    step = trainer.resume()
    out: dict[str, Any] = {"step": step, "resumed_from": trainer.resumed_from}
    if trainer.resumed_from == "store":
        assert trainer.replicas is not None, "no replica server: set INFRACTL_REPLICA_ADDR"
        trainer.replicas.save(step, trainer._state(None), extra={"reason": "replica"})
        trainer.replicas.close()
    else:
        from_store = _trainer(
            spec.model_copy(update={"checkpoint": spec.checkpoint.model_copy(update={"replicate_every": 0})}),
            args,
            env,
            device,
            "store-only",
        )
        from_store.resume()
        out |= {"replica": _whole(trainer), "store": _whole(from_store), "store_resumed_from": from_store.resumed_from}
        from_store.checkpointer.close()
    trainer.checkpointer.close()
    if env.rank == 0:
        torch.save(out, args.out)


if __name__ == "__main__":
    torchrun_script.run(_roundtrip)

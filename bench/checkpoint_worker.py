"""Worker for bench/trainer.py part (b): how long training is blocked per checkpoint.

Run under torchrun. Saves the same model and optimizer state ``--saves`` times with the
trainer's Checkpointer, asynchronously (training blocked only by ``save``, which stages to host
memory) and synchronously (``save`` then ``wait``: blocked until written, uploaded and committed).
Rank 0 prints one JSON line with the blocked seconds of every save, each way.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from infractl.store import open_store
from trainer.checkpoint import Checkpointer
from trainer.model import GPT, VOCAB_SIZE, GPTConfig
from trainer.stateful import ModelState, optimizer_state


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, required=True)
    parser.add_argument("--hidden", type=int, required=True)
    parser.add_argument("--saves", type=int, required=True)
    parser.add_argument("--store", required=True)
    parser.add_argument("--workdir", type=Path, required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    try:
        results, params = _measure(args)
    finally:
        # As trainer/train.py: DDP's reducer must be freed before the group is destroyed, or the
        # group's destructor can deadlock at exit joining gloo threads that wait for the GIL.
        gc.collect()
        dist.destroy_process_group()
    if int(os.environ["RANK"]) == 0:  # set by torchrun
        print(json.dumps({"blocked_s": results, "params": params, "world_size": int(os.environ["WORLD_SIZE"])}))


def _measure(args: argparse.Namespace) -> tuple[dict[str, list[float]], int]:
    """The saves, timed; the model and optimizer live only in this frame (see main)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DistributedDataParallel(GPT(GPTConfig(args.layers, args.hidden, 4, 64)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def train_step() -> None:
        tokens = torch.randint(0, VOCAB_SIZE, (4, 65))
        loss = F.cross_entropy(model(tokens[:, :-1]).reshape(-1, VOCAB_SIZE), tokens[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    train_step()  # the optimizer state exists from the first step on
    results: dict[str, list[float]] = {}
    step = 0
    for mode in ("async", "sync"):
        checkpointer = Checkpointer(
            open_store(args.store),
            run_id=f"bench-{mode}",
            workdir=args.workdir,
            rank=rank,
            world_size=world,
            keep=2,
        )
        blocked = []
        for _ in range(args.saves):
            step += 1
            state = {"model": ModelState(model), "optimizer": optimizer_state(model, optimizer)}
            started = time.perf_counter()
            checkpointer.save(step, state, extra={})
            if mode == "sync":
                checkpointer.wait()
            blocked.append(time.perf_counter() - started)
            for _ in range(3):  # training goes on while an async save is written and uploaded
                train_step()
        checkpointer.close()
        results[mode] = blocked
    return results, sum(p.numel() for p in model.parameters())


if __name__ == "__main__":
    main()

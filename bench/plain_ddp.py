"""The baseline for bench/trainer.py: the plainest torchrun DDP loop over the same model and data.

No checkpoints, no metrics store, no resume logic: what a team writes on day one. Run under
torchrun; rank 0 prints one JSON line with every step's time.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from infractl.config import DataSpec
from infractl.dataset import open_dataset
from trainer.model import GPT, VOCAB_SIZE, GPTConfig


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("layers", "hidden", "heads", "seq-len", "batch-size", "steps"):
        parser.add_argument(f"--{name}", type=int, required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DistributedDataParallel(GPT(GPTConfig(args.layers, args.hidden, args.heads, args.seq_len)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    corpus = torch.from_numpy(open_dataset(DataSpec()).tokens("train").copy()).long()
    per_rank = args.batch_size // world
    generator = torch.Generator().manual_seed(rank)
    times = []
    for _ in range(args.steps):
        started = time.perf_counter()
        starts = torch.randint(0, len(corpus) - args.seq_len - 1, (per_rank,), generator=generator)
        windows = torch.stack([corpus[s : s + args.seq_len + 1] for s in starts.tolist()])
        logits = model(windows[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), windows[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - started)
    if rank == 0:
        print(json.dumps({"step_times": times, "world_size": world, "threads": os.environ.get("OMP_NUM_THREADS")}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""The baseline for bench/trainer.py: a plain torchrun DDP loop doing exactly the trainer's math.

The same model code and initialization, data order, AdamW with its warm-up and cosine schedule,
gradient clipping and mixed precision as the infractl trainer; nothing else: no metrics, no
watchdog, no preemption, no checkpoints, no loss read back. The benchmark's ratio is therefore
infractl's own overhead. Run under torchrun; rank 0 prints one JSON line with the seconds per
step between the two ``--window`` steps (the device synchronized at both).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import time

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from infractl.config import RunSpec
from infractl.dataset import open_dataset
from trainer.data import ByteBatches
from trainer.distributed import DistEnv, destroy_process_group, init_process_group
from trainer.engine import GRAD_CLIP
from trainer.model import GPT, VOCAB_SIZE, GPTConfig
from trainer.optimizer import build_optimizer, build_scheduler
from trainer.parallelize import compute_dtype
from trainer.stateful import seed_everything


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True, help="The RunSpec JSON the trainer ran (ddp only).")
    parser.add_argument(
        "--window",
        type=int,
        nargs=2,
        required=True,
        metavar=("FROM", "TO"),
        help="Synchronize after these two steps and report the seconds between them.",
    )
    args = parser.parse_args()
    with open(args.spec) as f:
        spec = RunSpec.model_validate_json(f.read())
    env = DistEnv.from_environ()
    device = init_process_group(env)
    try:
        step_s = _train(spec, env, device, window=args.window)
    finally:
        # As trainer/train.py: DDP's reducer must be freed before the group is destroyed, or the
        # group's destructor can deadlock at exit joining gloo threads that wait for the GIL.
        gc.collect()
        destroy_process_group()
    if env.rank == 0:
        print(json.dumps({"step_s": step_s, "world_size": env.world_size}))


def _train(spec: RunSpec, env: DistEnv, device: torch.device, *, window: tuple[int, int]) -> float:
    """The loop; the model, optimizer and data live only in this frame (see main)."""
    model = GPT(GPTConfig.from_spec(spec.model), seed=spec.seed)  # the trainer's initial weights
    seed_everything(spec.seed + env.rank)
    model = DistributedDataParallel(model.to(device), device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = build_optimizer(model, lr=spec.lr)
    scheduler = build_scheduler(optimizer, total_steps=spec.steps)
    data = ByteBatches(
        open_dataset(spec.data).tokens("train"),
        seq_len=spec.model.seq_len,
        batch_size=spec.batch_size,
        seed=spec.seed,
        rank=env.rank,
        world_size=env.world_size,
    )
    autocast = (
        contextlib.nullcontext()
        if spec.mixed_precision == "fp32"
        else torch.autocast(device.type, dtype=compute_dtype(spec.mixed_precision))
    )
    marks: dict[int, float] = {}
    for step in range(1, spec.steps + 1):
        inputs, targets = (t.to(device, non_blocking=True) for t in data.batch(step))
        with autocast:
            logits = model(inputs)
        loss = F.cross_entropy(logits.float().reshape(-1, VOCAB_SIZE), targets.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        optimizer.step()
        scheduler.step()
        if step in window:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            marks[step] = time.time()
    first, last = window
    return (marks[last] - marks[first]) / (last - first)


if __name__ == "__main__":
    main()

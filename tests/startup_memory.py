"""Under torchrun: what a rank's start-up costs in host memory, and the initial weights it made::

    torchrun --nproc-per-node=N tests/startup_memory.py --spec SPEC.json --store URI --run-id RUN \\
        --workdir DIR --out FILE [--train]

Every rank builds the run's ``Trainer`` (its layout's model, built on the meta device and
materialized shard by shard) while a sampler records the peak of its anonymous resident memory
(trainer/memprobe.py), then compares every parameter, whole (an all-gather per DTensor), with the
value a model built whole in one process has for the run's seed. Each rank writes
``FILE.rank<r>.json``: ``{"baseline", "peak", "model_bytes", "held", "mismatched"}``. With
``--train`` the ranks then train the run and checkpoint it as its spec says.
"""

from __future__ import annotations

import argparse
import json

import torch
import torchrun_script
from torch.distributed.tensor import DTensor

from infractl.config import load_run_json
from infractl.store import open_store
from trainer import memprobe
from trainer.distributed import DistEnv
from trainer.engine import Trainer
from trainer.model import GPT, GPTConfig


def _startup(args: argparse.Namespace, env: DistEnv, device: torch.device) -> None:
    spec = load_run_json(args.spec)
    baseline = memprobe.start()
    with memprobe.PeakSampler() as sampler:
        trainer = Trainer(
            spec, store=open_store(args.store), run_id=args.run_id, workdir=args.workdir, env=env, device=device
        )
    held = dict(trainer.model.named_parameters())
    whole = {name: p.full_tensor() if isinstance(p, DTensor) else p.detach() for name, p in held.items()}
    reference = GPT(GPTConfig.from_spec(spec.model), seed=spec.seed).state_dict()
    report = {
        "baseline": baseline,
        "peak": sampler.peak,
        "model_bytes": sum(t.numel() * t.element_size() for t in reference.values()),
        "held": sorted(name.removeprefix("module.") for name in held),
        "mismatched": sorted(
            name for name, value in whole.items() if not torch.equal(value, reference[name.removeprefix("module.")])
        ),
    }
    if args.train:
        trainer.train()
    else:
        trainer.checkpointer.close()
    args.out.with_name(f"{args.out.name}.rank{env.rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    torchrun_script.run(_startup, switches=["--train"])

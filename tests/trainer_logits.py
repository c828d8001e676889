"""Under torchrun: the trainer's own model at a run's newest committed step, and its logits::

    torchrun --nproc-per-node=N tests/trainer_logits.py --spec SPEC.json --store URI --run-id RUN \\
        --workdir DIR --out FILE

Every rank builds the run's ``Trainer`` (the scheme's parallel model: fsdp's shards, ddp's
replicas), resumes it from the store exactly as a training job does, and runs the model on fixed
inputs; rank 0 saves ``{"step", "inputs", "logits"}`` to FILE. tests/test_export.py compares the
exported weights against these logits.
"""

from __future__ import annotations

import argparse

import torch
import torchrun_script

from infractl.config import load_run_json
from infractl.store import open_store
from trainer.distributed import DistEnv
from trainer.engine import Trainer

# Two sequences of 32 bytes: the tests' runs have seq_len 32.
INPUTS = torch.tensor(
    [list(b"def export(run, out, fmt):\n    r"), list(b"The trained model leaves with th")], dtype=torch.long
)


def _logits(args: argparse.Namespace, env: DistEnv, device: torch.device) -> None:
    # The Trainer lives only in this frame: freed before the process group (see trainer/train.py).
    trainer = Trainer(
        load_run_json(args.spec),
        store=open_store(args.store),
        run_id=args.run_id,
        workdir=args.workdir,
        env=env,
        device=device,
    )
    step = trainer.resume()
    with torch.no_grad():
        logits = trainer.model(INPUTS.to(device))  # a collective under fsdp: every rank runs it
    trainer.checkpointer.close()
    if env.rank == 0:
        torch.save({"step": step, "inputs": INPUTS, "logits": logits.float().cpu()}, args.out)


if __name__ == "__main__":
    torchrun_script.run(_logits)

"""The frame of the tests' scripts that torchrun runs (tests/trainer_logits.py,
tests/replica_roundtrip.py, tests/startup_memory.py): their common arguments (a run's spec, store
and id, the workdir, the file rank 0 writes), a script's own switches, and the process group around
their body."""

from __future__ import annotations

import argparse
import gc
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from trainer.distributed import DistEnv, destroy_process_group, init_process_group

Body = Callable[[argparse.Namespace, DistEnv, torch.device], None]


def run(body: Body, *, switches: Sequence[str] = ()) -> None:
    """Parse the arguments (``switches``: the script's own flags, off unless given), join the
    job's process group, run ``body`` on this rank, leave."""
    parser = argparse.ArgumentParser()
    for name in ("--spec", "--workdir", "--out"):
        parser.add_argument(name, type=Path, required=True)
    for name in switches:
        parser.add_argument(name, action="store_true")
    parser.add_argument("--store", required=True)
    parser.add_argument("--run-id", required=True)
    args = parser.parse_args()
    env = DistEnv.from_environ()
    device = init_process_group(env)
    try:
        body(args, env, device)
    finally:
        gc.collect()  # the body's Trainer is freed before the process group (see trainer/train.py)
        destroy_process_group()

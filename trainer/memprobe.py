"""The memory probe behind ``infractl plan --measure``: a few real training steps on every rank,
and the bytes each component of the budget actually took (infractl/planning/memory.py predicts
the same components).

- parameters, gradients, optimizer state, and activations (the tensors autograd saves for the
  backward pass, less saved weights, which are reported apart as ``autocast_copies``): counted
  as trainer/held.py counts them. The first step is left out when there are more
  (it also runs one-off work: a pipeline stage's forward that infers its shapes). Under tensor
  parallel a saved DTensor counts its local shard. Under activation checkpointing a block's
  saves happen again during the backward pass, out of the hook's sight: after the steps, the
  forward of the first block this rank holds is run once more at its micro-batch, with
  checkpointing off, to count them (less its kept input);
- peak: on CUDA ``torch.cuda.max_memory_allocated`` (and a memory snapshot for
  pytorch.org/memory_viz goes to the store); on the CPU the growth of the process's anonymous
  resident memory from before the model was built to its peak. glibc's malloc would keep freed
  tensors' memory in its arenas once its mmap threshold adapts upwards (22% to 115% more
  resident memory for the runs in examples/memory/); the probe fixes the threshold
  (``mallopt``), so every tensor above 64 KiB is mapped and unmapped, and the resident peak
  follows the tensors' peak as ``max_memory_allocated`` does on CUDA.

Every rank writes its report to ``runs/<run>/memory/rank-<r>.json``; nothing is checkpointed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import pickle
import threading
from typing import Any

import torch
from torch.distributed._composable.checkpoint_activation import checkpoint
from torch.nn.parallel import DistributedDataParallel

from infractl import runstore
from infractl.log import get_logger
from infractl.store import Store, StoreError
from trainer.engine import Trainer
from trainer.held import SavedTensors, optimizer_bytes, tensor_bytes
from trainer.model import GPT

__all__ = ["PeakSampler", "start", "measure"]

log = get_logger(__name__)

#: glibc's mallopt parameter for the mmap threshold; setting it turns its adaptation off.
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_BYTES = 64 << 10


def start() -> int:
    """Before the model is built: fix glibc's mmap threshold (see the module docstring) and
    return the resident bytes the peak is measured from."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    if not libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES):
        log.warning("mallopt_refused", effect="resident memory may include freed tensors")
    return resident_bytes()


def resident_bytes() -> int:
    """This process's anonymous resident memory now: heap and anonymous maps, what tensors live
    in. Not the whole resident set: libtorch's code pages, paged in as kernels are first used,
    would count a hundred MiB that no allocation made."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise OSError("no RssAnon in /proc/self/status")


class PeakSampler:
    """The highest ``resident_bytes`` seen, sampled every millisecond by a daemon thread (the
    kernel keeps the peak of the whole resident set only)."""

    def __init__(self) -> None:
        self.peak = resident_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memprobe", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, resident_bytes())

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, resident_bytes())


def _recomputed_block_bytes(trainer: Trainer, saved: SavedTensors) -> int:
    """Under activation checkpointing: what one block saves when the backward pass recomputes
    it, less its input (kept anyway). One block's forward with checkpointing off, on a fresh
    input of the step's shape (under tensor parallel, this rank's share of the tokens); under
    fsdp every rank runs it (it gathers the block's weights)."""
    model = trainer.model.module if isinstance(trainer.model, DistributedDataParallel) else trainer.model
    assert isinstance(model, GPT)
    block = next(iter(model.blocks.values()))  # a later pipeline stage has no block "0"
    spec = trainer.spec
    micro = trainer.layout.micro_batch
    # Under tensor parallel a block takes this rank's share of the tokens (sequence parallel).
    tokens = spec.model.seq_len // trainer.layout.tp
    # Not a leaf: a leaf that requires grad is a weight to the pack hook.
    leaf = torch.zeros(micro, tokens, spec.model.hidden, device=trainer.device, requires_grad=True)
    x = leaf.clone()
    state = checkpoint.state(block)
    state.enable_hook = False
    try:
        with saved.watching(), trainer._autocast():
            block(x)
    finally:
        state.enable_hook = True
    input_bytes = x.untyped_storage().nbytes()
    return sum(saved.activations.values()) - input_bytes


def measure(trainer: Trainer, *, steps: int, store: Store, run_id: str, baseline_rss: int) -> dict[str, Any]:
    """Train ``steps`` steps (no checkpoint, no resume), then write and return this rank's report.
    ``baseline_rss``: resident bytes before the model was built (CPU peak = growth from it)."""
    cuda = trainer.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(trainer.device)
        torch.cuda.memory._record_memory_history(max_entries=100_000)
    # An emulated device counts with the same hook (only the innermost hook sees the saves).
    saved = trainer.emulated or SavedTensors(trainer.model)
    activations = copies = 0
    with PeakSampler() as sampler:
        for step in range(1, steps + 1):
            with saved.watching():
                trainer._train_step(step, first=step == 1)
            if step > 1 or steps == 1:
                activations = max(activations, sum(saved.activations.values()))
                copies = max(copies, sum(saved.copies.values()))
    peak = torch.cuda.max_memory_allocated(trainer.device) if cuda else sampler.peak - baseline_rss
    if trainer.spec.activation_checkpointing:
        activations += _recomputed_block_bytes(trainer, saved)
    report: dict[str, Any] = {
        "rank": trainer.env.rank,
        "world_size": trainer.env.world_size,
        "device": trainer.device.type,
        "steps": steps,
        "dp": trainer.layout.dp,
        "micro_batch": trainer.layout.micro_batch,
        "parameters": sum(tensor_bytes(p) for p in trainer.model.parameters()),
        "gradients": sum(tensor_bytes(p.grad) for p in trainer.model.parameters() if p.grad is not None),
        "optimizer": optimizer_bytes(trainer.optimizer),
        "activations": activations,
        "autocast_copies": copies,
        "peak": peak,
        "peak_source": "torch.cuda.max_memory_allocated" if cuda else "resident memory growth",
    }
    if cuda:
        report["snapshot"] = _upload_snapshot(store, run_id, trainer.env.rank)
    store.put_bytes(runstore.memory_report_key(run_id, trainer.env.rank), json.dumps(report, indent=1).encode())
    trainer.saves.close()
    log.info("memory_measured", **{k: v for k, v in report.items() if isinstance(v, int)})
    return report


def _upload_snapshot(store: Store, run_id: str, rank: int) -> str | None:
    """The CUDA caching allocator's snapshot (every allocation with its stack), for
    pytorch.org/memory_viz; None when the store refuses it (the report still goes)."""
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    key = runstore.memory_report_key(run_id, rank).replace(".json", ".snapshot.pickle")
    try:
        store.put_bytes(key, pickle.dumps(snapshot))
    except StoreError as exc:
        log.warning("memory_snapshot_not_saved", error=str(exc))
        return None
    return key

"""Which samples each rank trains (and validates) on at each step. The bytes come from
``infractl.dataset`` (a prepared dataset or the built-in stdlib corpus).

Sample ``i`` is the window ``corpus[i*seq_len : i*seq_len + seq_len + 1]`` (inputs and the
next-byte targets). The order of samples is a fixed permutation per epoch, seeded by
``(seed, epoch)``; step ``s`` takes the next ``batch_size`` samples of that sequence and
data-parallel rank ``r`` of ``world_size`` takes its contiguous share of them
(``infractl.config.split_batch``: the first ``batch_size % world_size`` ranks take one more).
So a rank's batch is a pure function of ``(seed, step, rank, world_size)``, ranks never share a
sample within a step, the global batch does not depend on the world size, and resuming at step
``s`` needs no replay. ``rank`` and ``world_size`` here are data-parallel: the tensor- and
pipeline-parallel ranks of one model copy train on the same samples (trainer/mesh.py).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import numpy as np
import torch

from infractl.config import split_batch
from trainer.errors import RunRefused

__all__ = [
    "num_samples",
    "sample_indices",
    "ByteBatches",
    "ValidationBatches",
]


def num_samples(corpus_len: int, seq_len: int) -> int:
    """Whole samples (``seq_len`` inputs plus one target byte) the corpus holds."""
    count = (corpus_len - 1) // seq_len
    if count < 1:
        raise RunRefused(
            f"data: the split ({corpus_len} bytes) is shorter than one sample (model.seq_len + 1 = {seq_len + 1} bytes)"
        )
    return count


@functools.lru_cache(maxsize=4)
def _epoch_order(seed: int, epoch: int, count: int) -> np.ndarray:
    order = np.random.Generator(np.random.PCG64([seed, epoch])).permutation(count)
    order.flags.writeable = False
    return order


def sample_indices(*, seed: int, step: int, rank: int, world_size: int, batch_size: int, samples: int) -> np.ndarray:
    """Indices of the samples ``rank`` trains on at ``step`` (1-based); a pure function."""
    if step < 1:
        raise ValueError("step must be at least 1 (steps are 1-based)")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size})")
    shares = split_batch(batch_size, world_size)
    per_rank = shares[rank]
    first = (step - 1) * batch_size + sum(shares[:rank])
    epochs, offsets = np.divmod(np.arange(first, first + per_rank, dtype=np.int64), samples)
    out = np.empty(per_rank, dtype=np.int64)
    for epoch in np.unique(epochs):
        where = epochs == epoch
        out[where] = _epoch_order(seed, int(epoch), samples)[offsets[where]]
    return out


class ByteBatches:
    """The batches one rank trains on: ``batch(step)`` -> (inputs, targets), int64 (batch, seq)."""

    def __init__(
        self,
        corpus: np.ndarray,
        *,
        seq_len: int,
        batch_size: int,
        seed: int,
        rank: int,
        world_size: int,
    ) -> None:
        self.corpus = corpus
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.samples = num_samples(len(corpus), seq_len)
        self._window = np.arange(seq_len + 1, dtype=np.int64)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        indices = sample_indices(
            seed=self.seed,
            step=step,
            rank=self.rank,
            world_size=self.world_size,
            batch_size=self.batch_size,
            samples=self.samples,
        )
        windows = torch.from_numpy(self.corpus[indices[:, None] * self.seq_len + self._window])
        windows = windows.long()
        return windows[:, :-1], windows[:, 1:]


class ValidationBatches:
    """A fixed validation set: the first ``batches`` global batches of the split, in order.

    Rank ``r`` takes its contiguous share of each, so every rank sees different samples and the
    set is the same at any world size (the mean over all ranks is the validation loss).
    """

    def __init__(
        self, tokens: np.ndarray, *, seq_len: int, batch_size: int, batches: int, rank: int, world_size: int
    ) -> None:
        self.tokens = tokens
        self.seq_len = seq_len
        shares = split_batch(batch_size, world_size)
        first, count = sum(shares[:rank]), shares[rank]
        samples = num_samples(len(tokens), seq_len)
        total = min(batches * batch_size, samples - samples % batch_size)
        if total == 0:
            raise RunRefused(
                f"data: the validation split holds {samples} sample(s), fewer than one batch ({batch_size}); "
                "raise data.val_fraction or turn evaluation off (eval.every: 0)"
            )
        starts = [b + first for b in range(0, total, batch_size)]
        self._indices = [np.arange(s, s + count, dtype=np.int64) for s in starts]
        self._window = np.arange(seq_len + 1, dtype=np.int64)

    def __len__(self) -> int:
        return len(self._indices)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for indices in self._indices:
            windows = torch.from_numpy(self.tokens[indices[:, None] * self.seq_len + self._window]).long()
            yield windows[:, :-1], windows[:, 1:]

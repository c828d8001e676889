"""A small GPT-style byte-level language model (vocabulary: the 256 byte values).

A pipeline stage is the same ``GPT`` with the parts other stages hold removed (``stage``):
parameter names, and so checkpoint keys, are the whole model's in every layout.

Initial weights are a function of the seed and each parameter's name (``initial_value``), not
of the order parameters are built in or of how they are spread over ranks: the trainer builds the
model on the meta device, splits it, and each rank fills in only what it holds
(``GPT.init_weights``), with the values a whole model built on one process has.
"""

from __future__ import annotations

import copy
import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from infractl.config import ModelSpec

__all__ = ["VOCAB_SIZE", "GPTConfig", "GPT", "initial_value", "token_loss"]

VOCAB_SIZE = 256


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the tokens, in fp32 whatever the compute dtype."""
    return F.cross_entropy(logits.float().reshape(-1, VOCAB_SIZE), targets.reshape(-1))


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the model."""

    layers: int
    """Transformer blocks."""
    hidden: int
    """Width of the residual stream; divisible by ``heads``."""
    heads: int
    """Attention heads per block."""
    seq_len: int
    """Longest input, in tokens (bytes); sizes the position embedding."""

    def __post_init__(self) -> None:
        if self.layers < 1:
            raise ValueError("layers must be at least 1")
        if self.heads < 1 or self.hidden % self.heads:
            raise ValueError("hidden must be divisible by heads")
        if self.seq_len < 1:
            raise ValueError("seq_len must be at least 1")

    @classmethod
    def from_spec(cls, spec: ModelSpec) -> GPTConfig:
        return cls(layers=spec.layers, hidden=spec.hidden, heads=spec.heads, seq_len=spec.seq_len)


class _Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.head_dim = cfg.hidden // cfg.heads
        # Separate projections, so tensor parallel can split each by columns into whole heads.
        self.q = nn.Linear(cfg.hidden, cfg.hidden)
        self.k = nn.Linear(cfg.hidden, cfg.hidden)
        self.v = nn.Linear(cfg.hidden, cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        if torch.is_autocast_enabled(x.device.type):
            # Cast once: under autocast q, k and v would each cast x again and keep their own
            # copy of it for the backward pass.
            x = x.to(torch.get_autocast_dtype(x.device.type))
        q, k, v = self.q(x), self.k(x), self.v(x)
        # Under tensor parallel a rank computes its own heads only: a fraction of the width.
        width = q.shape[-1]
        q, k, v = (t.view(batch, seq, width // self.head_dim, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out: torch.Tensor = self.proj(y.transpose(1, 2).reshape(batch, seq, width))
        return out


class _MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.hidden, 4 * cfg.hidden)
        self.proj = nn.Linear(4 * cfg.hidden, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.proj(F.gelu(self.fc(x)))
        return out


class _Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.attn = _Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.hidden)
        self.mlp = _MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        out: torch.Tensor = x + self.mlp(self.ln2(x))
        return out


class GPT(nn.Module):
    """Pre-norm decoder-only transformer; the output projection reuses the token embedding."""

    sequence_mesh: DeviceMesh | None = None
    """Set under tensor parallel with sequence parallel (trainer/parallelize.py): the residual
    stream is split along the tokens over this mesh before the blocks, and gathered after them.
    In the model's forward rather than in module hooks, so activation checkpointing, which runs a
    block's forward again, does not split an input twice."""

    def __init__(self, cfg: GPTConfig, *, seed: int = 0) -> None:
        """Built where the default device says; initialised from ``seed`` unless that is the
        meta device (then ``init_weights`` once the parameters have storage)."""
        super().__init__()
        self.cfg = cfg
        self.tok_emb: nn.Embedding | None = nn.Embedding(VOCAB_SIZE, cfg.hidden)
        self.pos_emb: nn.Embedding | None = nn.Embedding(cfg.seq_len, cfg.hidden)
        # Keyed "0", "1", ...: the names a ModuleList would give, and they stay when a
        # pipeline stage drops the blocks it does not run.
        self.blocks = nn.ModuleDict({str(i): _Block(cfg) for i in range(cfg.layers)})
        self.ln_f: nn.LayerNorm | None = nn.LayerNorm(cfg.hidden)
        if not self.ln_f.weight.is_meta:
            self.init_weights(seed)

    def keep_stages(self, indices: Sequence[int], stages: int) -> None:
        """Drop, in place, what none of pipeline stages ``indices`` (of ``stages``) runs. A
        stage runs its share of the blocks; the first stage also the embeddings; the last stage
        the final norm and the token embedding for the tied output projection (the first and
        last stage each hold a copy, and their gradients are summed; see trainer/parallelize.py)."""
        keep = {name for index in indices for name in _stage_blocks(index, stages, self.cfg.layers)}
        for name in [n for n in self.blocks if n not in keep]:
            del self.blocks[name]
        first, last = 0 in indices, stages - 1 in indices
        if not first:
            self.pos_emb = None
        if not last:
            self.ln_f = None
        if not (first or last):
            self.tok_emb = None

    def stage(self, index: int, stages: int) -> GPT:
        """Pipeline stage ``index`` of ``stages``: a GPT that shares this model's modules (and
        so its parameters) and holds only what that stage runs. It takes tokens if it is the
        first stage, else the previous stage's activations; it returns logits if it is the
        last, else its activations. This model must hold the stage (``keep_stages``)."""
        view = copy.copy(self)
        view._modules = dict(self._modules)  # its own registry of the same modules
        view.blocks = nn.ModuleDict({n: self.blocks[n] for n in _stage_blocks(index, stages, self.cfg.layers)})
        view.keep_stages([index], stages)
        return view

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Give every parameter this model holds its initial value for ``seed``
        (``initial_value``); a DTensor (fsdp, tensor parallel) takes this rank's part of it.
        One whole parameter at a time exists besides the model: the largest is the peak."""
        for name, param in self.named_parameters():
            value = initial_value(name, tuple(param.shape), seed=seed, layers=self.cfg.layers, dtype=param.dtype)
            if isinstance(param, DTensor):
                # src_data_rank=None: each rank cuts its own part of its own copy, no communication.
                part = distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None)
                param.to_local().copy_(part.to_local())
            else:
                param.copy_(value)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of shape (batch, seq, 256) for ``tokens`` of shape (batch, seq)."""
        x = tokens
        if self.pos_emb is not None:  # the first stage (or the whole model)
            assert self.tok_emb is not None
            seq = tokens.shape[1]
            if seq > self.cfg.seq_len:
                raise ValueError(f"input has {seq} tokens; the model takes at most {self.cfg.seq_len}")
            x = self.tok_emb(tokens) + self.pos_emb(torch.arange(seq, device=tokens.device))
        if self.sequence_mesh is not None:
            x = _split_sequence(x, self.sequence_mesh)
        for block in self.blocks.values():
            x = block(x)
        if self.sequence_mesh is not None:
            x = _gather_sequence(x, self.sequence_mesh)
        if self.ln_f is None:  # a stage before the last
            return x
        assert self.tok_emb is not None
        # Weight tying through F.linear (not a second module sharing the tensor) keeps
        # one name per parameter, which keeps checkpoint keys unambiguous.
        return F.linear(self.ln_f(x), self.tok_emb.weight)


def initial_value(
    name: str, shape: tuple[int, ...], *, seed: int, layers: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Parameter ``name``'s initial value in a model of ``layers`` blocks, on the CPU: GPT-2's
    initialisation (biases zero, norms' weights one, matrices normal with std 0.02, the residual
    projections scaled down by depth so the residual stream's variance does not grow with it),
    drawn from a generator seeded by ``seed`` and ``name`` alone."""
    if name.endswith("bias"):
        return torch.zeros(shape, dtype=dtype)
    if "ln" in name:
        return torch.ones(shape, dtype=dtype)
    std = 0.02 / math.sqrt(2 * layers) if name.endswith("proj.weight") else 0.02
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    return torch.empty(shape, dtype=dtype).normal_(std=std, generator=generator)


def _stage_blocks(index: int, stages: int, layers: int) -> list[str]:
    """Names of the blocks pipeline stage ``index`` of ``stages`` runs: an equal, contiguous share."""
    per_stage = layers // stages
    return [str(i) for i in range(index * per_stage, (index + 1) * per_stage)]


def _split_sequence(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """This rank's share of the tokens of the whole ``x`` (batch, seq, hidden); no communication
    (the backward pass gathers the gradient)."""
    return DTensor.from_local(x, mesh, [Replicate()]).redistribute(mesh, [Shard(1)]).to_local()


def _gather_sequence(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """The whole ``x`` from every rank's share of the tokens (an all-gather)."""
    return DTensor.from_local(x, mesh, [Shard(1)]).redistribute(mesh, [Replicate()]).to_local()

"""How the model is spread over ranks. One entry point, ``parallelize``, for every layout.

Data parallel alone (tp = pp = 1) runs on the default process group:

- ``ddp``: every rank holds the whole model and optimizer; gradients are all-reduced.
- ``zero1``: DDP, and AdamW's state sharded over the ranks (see ``optimizer.build_optimizer``).
- ``fsdp``: FSDP2 ``fully_shard`` on each transformer block and at the root: weights,
  gradients and optimizer state are DTensors sharded over the ranks.

Tensor and pipeline parallel run on a ``(pp, dp, tp)`` device mesh (trainer/mesh.py), the
way torchtitan composes PyTorch's own parts:

- ``tp``: DTensor ``parallelize_module`` on each block: Q, K, V and the MLP's up projection
  split by columns (each rank computes whole heads), the attention output and the MLP's down
  projection by rows; between them, sequence parallel: the residual stream and the norms are
  split along the tokens (``_TP_PLAN``). Embeddings, the final norm and the output projection
  stay replicated.
- ``pp``: each rank keeps its stage of the model, or two with ``interleaved-1f1b``
  (``GPT.keep_stages``, ``GPT.stage``), run by a ``torch.distributed.pipelining`` schedule
  (trainer/pipeline.py). The first and last stage both hold the tied token embedding; their
  gradients are summed after the backward pass.
- data parallel across the ``dp`` dimension: ``fsdp`` shards with ``fully_shard`` on the
  ``dp`` sub-mesh (a 2-D mesh with tp); ``ddp`` averages the gradients over the ``dp`` group
  in one all-reduce after the backward pass.

A world of one rank goes through the same path: parallel degree 1 is a normal mode.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable.checkpoint_activation import checkpoint
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.nn.parallel import DistributedDataParallel

from infractl.config import ParallelSpec, RunSpec
from trainer.mesh import Layout
from trainer.model import GPT

if TYPE_CHECKING:
    from trainer.pipeline import Pipeline

__all__ = ["Precision", "Parallel", "parallelize", "compute_dtype", "local_tensor"]

Precision = Literal["fp32", "bf16"]

#: Each block's tensor-parallel plan, with sequence parallel between the blocks: the residual
#: stream is split along the sequence over the tp ranks, the norms run on their share of the
#: tokens, each sub-layer gathers its input (all-gather) and its row-wise output is summed back
#: into sequence shards (reduce-scatter): the same traffic as one all-reduce, and the stream's
#: activations and the norms' work divided by tp.
_TP_PLAN = {
    "ln1": SequenceParallel(),
    "attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
    "attn.q": ColwiseParallel(),
    "attn.k": ColwiseParallel(),
    "attn.v": ColwiseParallel(),
    "attn.proj": RowwiseParallel(output_layouts=Shard(1)),
    "ln2": SequenceParallel(),
    "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
    "mlp.fc": ColwiseParallel(),
    "mlp.proj": RowwiseParallel(output_layouts=Shard(1)),
}


def compute_dtype(precision: Precision) -> torch.dtype:
    return torch.bfloat16 if precision == "bf16" else torch.float32


class Parallel:
    """The parallelized model and what the step needs besides its forward and backward:
    ``reduce_and_clip`` after the backward pass."""

    def __init__(
        self,
        module: nn.Module,
        layout: Layout,
        mesh: DeviceMesh | None,
        *,
        sharded: bool,
        stages: Sequence[nn.Module] = (),
        parallel: ParallelSpec,
        device: torch.device,
    ) -> None:
        self.module = module
        """What the step calls, and what optimizer and checkpoints see: under a pipeline, every
        part of the model this rank holds."""
        self.pipeline: Pipeline | None = None
        """Under a pipeline, the schedule that runs this rank's stages (``GPT.stage`` of ``module``)."""
        if stages:
            assert mesh is not None
            # Imported by pipeline runs only: torch.distributed.pipelining imports torch.export
            # and dynamo (0.7 s a rank) and sets up libtorch's CPU runtime as it does, before the
            # baseline of `plan --measure`'s CPU peak, which would then leave that memory out.
            from trainer.pipeline import Pipeline

            self.pipeline = Pipeline(stages, parallel=parallel, layout=layout, mesh=mesh, device=device)
        self.layout = layout
        self.mesh = mesh
        """The ``(pp, dp, tp)`` mesh; None for data parallel alone."""
        # On the mesh, replicas' gradients are averaged here; FSDP reduce-scatters its own.
        self._dp_group = mesh["dp"].get_group() if mesh is not None and layout.dp > 1 and not sharded else None
        self._tied_group = _tied_embedding_group(layout) if layout.pp > 1 else None

    def reduce_and_clip(self, max_norm: float) -> torch.Tensor:
        """After the backward pass: finish the gradients (averaged over data-parallel ranks,
        the tied embedding's summed over its stages), clip them to ``max_norm`` in total, and
        return their global norm before clipping (the same tensor value on every rank)."""
        params = [p for p in self.module.parameters() if p.grad is not None]
        if self.mesh is None:  # DDP or FSDP have reduced them already
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
            # fsdp's norm is a replicated DTensor: every rank holds the global value.
            return norm.to_local() if isinstance(norm, DTensor) else norm
        for p in params:
            # Sequence parallel leaves the norms' gradients partial sums over the tp ranks
            # (each saw its share of the tokens): complete them, as the weights are replicated.
            if isinstance(p.grad, DTensor) and isinstance(p, DTensor) and p.grad.placements != p.placements:
                p.grad = p.grad.redistribute(p.grad.device_mesh, p.placements)
        grads = [local_tensor(p.grad) for p in params if p.grad is not None]
        if self._dp_group is not None:
            _all_reduce_flat(grads, self._dp_group, divide_by=self.layout.dp)
        if self._tied_group is not None:
            emb = getattr(self.module, "tok_emb", None)
            assert emb is not None and emb.weight.grad is not None, "the first and last stage hold tok_emb"
            _all_reduce_flat([local_tensor(emb.weight.grad)], self._tied_group, divide_by=1)
        norm = self._global_norm()
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for grad in grads:
            grad.mul_(coef)
        return norm

    def _global_norm(self) -> torch.Tensor:
        """The L2 norm of all gradients of the model, every rank counting each piece it holds
        only if no other rank holds the same piece (one all-reduce over the world)."""
        layout = self.layout
        device = next(self.module.parameters()).device
        total = torch.zeros((), dtype=torch.float32, device=device)
        for name, p in self.module.named_parameters():
            if p.grad is None:
                continue
            if layout.dp_rank and not _sharded_over(p, "dp"):
                continue  # a copy of data-parallel rank 0's
            if layout.tp_rank and not _sharded_over(p, "tp"):
                continue  # a copy of tensor-parallel rank 0's
            if layout.pp_rank and name == "tok_emb.weight":
                continue  # the last stage's copy of the first stage's
            total += local_tensor(p.grad).float().square().sum()
        dist.all_reduce(total)
        return total.sqrt()


def parallelize(model: GPT, *, spec: RunSpec, layout: Layout, device: torch.device) -> Parallel:
    """Apply the run's layout to ``model``, built on the meta device, then give each parameter
    storage on ``device`` and its initial value for the run's seed (``GPT.init_weights``): a
    rank allocates only what it holds (its stages, its tensor-parallel and fsdp shards). Under a
    pipeline, ``model`` becomes this rank's stage (``GPT.stage``) first."""
    if spec.cpu_offload and spec.parallel.dp_shard != "fsdp":
        raise ValueError(f"cpu_offload needs parallel: fsdp (got parallel: {spec.parallel.label})")
    mesh = None
    if layout.meshed:
        mesh = init_device_mesh(device.type, (layout.pp, layout.dp, layout.tp), mesh_dim_names=("pp", "dp", "tp"))
    if layout.pp > 1:
        model.keep_stages(layout.stage_indices, layout.stages)
    stages = [model.stage(index, layout.stages) for index in layout.stage_indices] if layout.pp > 1 else []
    if mesh is not None and layout.tp > 1:
        _tensor_parallel(model, stages, mesh["tp"])

    # Activation checkpointing before sharding: fully_shard then treats each checkpointed
    # block as one unit, and its hooks gather the block's weights for the recompute in the
    # backward pass as they do for the forward. The composable form adds hooks rather than
    # a wrapper module, so parameter names (and checkpoint keys) do not change with it.
    if spec.activation_checkpointing:
        for block in model.blocks.values():
            checkpoint(block)

    if spec.parallel.dp_shard == "fsdp":
        dp_mesh = mesh["dp"] if mesh is not None else init_device_mesh(device.type, (dist.get_world_size(),))
        _shard(model, stages, dp_mesh, precision=spec.mixed_precision, cpu_offload=spec.cpu_offload, device=device)
        # Offloaded shards live in host memory; fully_shard moves them to the device per use.
        _materialize(model, torch.device("cpu") if spec.cpu_offload else device, seed=spec.seed)
        return Parallel(model, layout, mesh, sharded=True, stages=stages, parallel=spec.parallel, device=device)
    _materialize(model, device, seed=spec.seed)
    if mesh is None:
        # DDP broadcasts rank 0's weights at construction; every rank computed the same ones.
        # zero1 differs only in its optimizer.
        device_ids = [device.index] if device.type == "cuda" else None
        ddp = DistributedDataParallel(model, device_ids=device_ids)
        return Parallel(ddp, layout, None, sharded=False, parallel=spec.parallel, device=device)
    return Parallel(model, layout, mesh, sharded=False, stages=stages, parallel=spec.parallel, device=device)


def _materialize(model: GPT, device: torch.device, *, seed: int) -> None:
    """Storage on ``device`` for what this rank holds of the meta-device ``model`` (fully_shard
    resets its shards' views as it does), then the initial values (``GPT.init_weights``)."""
    model.to_empty(device=device)
    model.init_weights(seed)


def _tensor_parallel(model: GPT, stages: list[GPT], mesh: DeviceMesh) -> None:
    """``_TP_PLAN`` on every block the model holds; each stage (or the whole model) splits the
    stream along the tokens before its blocks and gathers it after them (``GPT.sequence_mesh``)."""
    for block in model.blocks.values():
        parallelize_module(block, mesh, _TP_PLAN)
    for part in stages or [model]:
        part.sequence_mesh = mesh


def _shard(
    model: GPT,
    stages: list[GPT],
    mesh: DeviceMesh,
    *,
    precision: Precision,
    cpu_offload: bool,
    device: torch.device,
) -> None:
    """FSDP2 over ``mesh``. Mixed precision for ``ddp`` and ``zero1`` is the step's
    ``torch.autocast`` alone (the engine applies it for every layout); ``fsdp`` also gathers
    weights in that dtype. Under a pipeline each stage is a root of its own (a forward starts
    there), and ``model``, which only holds the stages' parts, is not sharded itself."""
    # Gradients are reduced in fp32 whatever the compute dtype: a bf16 sum over many ranks
    # loses the small updates that training depends on.
    mp_policy = MixedPrecisionPolicy(param_dtype=compute_dtype(precision), reduce_dtype=torch.float32)
    offload_policy = CPUOffloadPolicy(pin_memory=device.type == "cuda") if cpu_offload else OffloadPolicy()
    shard = functools.partial(fully_shard, mesh=mesh, mp_policy=mp_policy, offload_policy=offload_policy)
    # Blocks first, then the root: each block is its own unit of all-gather and
    # reduce-scatter (communication overlaps the neighbouring block's compute); the root
    # unit takes what is left (embeddings, final norm).
    for block in model.blocks.values():
        shard(block)
    # The root's weights (the tied embedding) are used again right after the last block,
    # in the output projection: resharding them after forward would only gather them again.
    for root in stages or [model]:
        shard(root, reshard_after_forward=False)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``: its shard of a DTensor (fsdp, tp), else the tensor."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _sharded_over(param: torch.Tensor, dim: str) -> bool:
    """Whether ``param`` is split (not replicated) over the mesh dimension named ``dim``."""
    if not isinstance(param, DTensor):
        return False
    names = param.device_mesh.mesh_dim_names or ()
    # Not is_shard(): FSDP shards a tensor-parallel shard along the same dimension with a
    # _StridedShard, which is no Shard.
    return dim in names and not param.placements[names.index(dim)].is_replicate()


def _all_reduce_flat(tensors: list[torch.Tensor], group: dist.ProcessGroup, *, divide_by: int) -> None:
    """Sum ``tensors`` over ``group`` in place, in one all-reduce, then divide by ``divide_by``."""
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    if divide_by != 1:
        flat /= divide_by
    parts = torch.split(flat, [t.numel() for t in tensors])
    for tensor, part in zip(tensors, parts, strict=True):
        tensor.copy_(part.view_as(tensor))


def _tied_embedding_group(layout: Layout) -> dist.ProcessGroup | None:
    """The group of the first and the last stage of this rank's pipeline; None on the stages
    between. Every rank creates every such group (``new_group`` is collective)."""
    stride = layout.dp * layout.tp
    mine = None
    for offset in range(stride):
        group = dist.new_group([offset, (layout.pp - 1) * stride + offset])
        if offset == layout.dp_rank * layout.tp + layout.tp_rank and layout.pp_rank in (0, layout.pp - 1):
            mine = group
    return mine

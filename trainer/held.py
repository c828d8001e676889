"""What a rank's tensors hold, component by component, as the planner sizes them
(infractl/planning/memory.py): the bytes of this rank's parameters, gradients and optimizer
state, and the tensors autograd saves for the backward pass. ``plan --measure``
(trainer/memprobe.py) reports them; an emulated device enforces a capacity on them.

- parameters, gradients, optimizer state: the exact bytes of this rank's tensors (the local
  shards under fsdp and tensor parallel, this rank's partition of AdamW's state under zero1);
- saved tensors: counted once per storage by a ``saved_tensors_hooks`` pack hook during the
  forward. Saved weights are not activations: parameters themselves are skipped, and
  autocast's bf16 copies of them (and views of those) are counted apart as copies.

**The emulated device.** A CPU rank has no device memory to run out of: with
``$INFRACTL_DEVICE_MEMORY`` (bytes; infractl/planning/devices.py) it rehearses a device of that
size. The runtime's reserve (as the planner counts it on the CPU), its parameters, their
gradients (counted from the start of the step, as a GPU allocates them in the backward pass),
its optimizer state and everything autograd saved so far in the step may not pass the capacity:
the allocation that would pass it raises ``torch.OutOfMemoryError`` part-way through the
forward, the exception CUDA raises, and the rank stops as it would on a GPU (``stopped
error="OutOfMemoryError: ..." reason=crashed``). It does not see a checkpointed block's
recomputation during the backward pass (one block, transient) nor temporaries autograd
does not save; the planner's budget counts both.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
from torch import nn

from infractl.config import RunSpec
from infractl.planning.devices import EMULATED_MEMORY_ENV, emulated_memory
from infractl.planning.plan import spec_budget
from trainer.mesh import Layout
from trainer.parallelize import local_tensor

__all__ = ["EmulatedDevice", "SavedTensors", "optimizer_bytes", "tensor_bytes"]

# Autograd nodes that pass a weight through unchanged in value: a saved tensor reached from a
# parameter through these alone is a copy or a view of the weight, not an activation.
_WEIGHT_PATH = ("TBackward", "ToCopyBackward", "TransposeBackward", "ViewBackward", "AliasBackward", "PermuteBackward")

_MIB = 1 << 20


def tensor_bytes(t: torch.Tensor) -> int:
    local = local_tensor(t)
    return local.numel() * local.element_size()


def optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    # zero1's ZeroRedundancyOptimizer keeps this rank's partition in an inner AdamW.
    inner = getattr(optimizer, "optim", optimizer)
    return sum(tensor_bytes(v) for state in inner.state.values() for v in state.values() if isinstance(v, torch.Tensor))


def _from_weight(t: torch.Tensor) -> bool:
    if t.is_leaf:
        return t.requires_grad
    node = t.grad_fn
    for _ in range(4):
        if node is None or not type(node).__name__.startswith(_WEIGHT_PATH):
            return False
        parents = [n for n, _ in node.next_functions if n is not None]
        if len(parents) != 1:
            return False
        node = parents[0]
        if type(node).__name__ == "AccumulateGrad":
            return True
    return False


class SavedTensors:
    """Bytes of the distinct storages autograd saves while it is active, by kind."""

    def __init__(self, model: nn.Module) -> None:
        self.params = {local_tensor(p).untyped_storage().data_ptr() for p in model.parameters()}
        self.activations: dict[int, int] = {}
        self.copies: dict[int, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        # Under tensor parallel autograd saves DTensors, which have no storage of their own.
        with torch.no_grad():
            storage = local_tensor(t).untyped_storage()
        key = storage.data_ptr()
        if key not in self.params:
            kind = self.copies if _from_weight(t) else self.activations
            kind.setdefault(key, storage.nbytes())
        return t

    @property
    def saved(self) -> int:
        return sum(self.activations.values()) + sum(self.copies.values())

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        self.activations.clear()
        self.copies.clear()
        with torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t):
            yield


class EmulatedDevice(SavedTensors):
    """A CPU rank's device of ``capacity`` bytes (the module docstring), of which the runtime
    holds ``reserve`` (the planner's reserve for the run)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, capacity: int, reserve: int) -> None:
        super().__init__(model)
        self.model = model
        self.optimizer = optimizer
        self.capacity = capacity
        self.reserve = reserve
        self.resident = 0  # the reserve, parameters, gradients and optimizer state, taken when a step starts

    @classmethod
    def from_environ(
        cls, model: nn.Module, optimizer: torch.optim.Optimizer, spec: RunSpec, layout: Layout, device: torch.device
    ) -> EmulatedDevice | None:
        """The device ``$INFRACTL_DEVICE_MEMORY`` sets for a CPU rank, if it does, of which the
        runtime holds what the planner says it holds on the CPU for ``spec`` on this layout."""
        capacity = emulated_memory(os.environ) if device.type == "cpu" else None
        if capacity is None:
            return None
        reserve = spec_budget(spec, ranks=layout.dp, micro_batch=layout.micro_batch, cuda=False).reserve
        return cls(model, optimizer, capacity=capacity, reserve=reserve)

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        params = list(self.model.parameters())
        self.resident = self.reserve + sum(tensor_bytes(p) for p in params)
        self.resident += sum(tensor_bytes(p) for p in params if p.requires_grad)
        self.resident += optimizer_bytes(self.optimizer)
        with super().watching():
            yield

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        before = self.saved
        super().pack(t)
        held = self.resident + self.saved
        if held > self.capacity:
            raise torch.OutOfMemoryError(
                f"out of memory on the emulated device (${EMULATED_MEMORY_ENV}): tried to allocate "
                f"{(self.saved - before) / _MIB:.2f} MiB; the device's capacity is {self.capacity / _MIB:.2f} MiB, "
                f"of which the runtime's reserve, parameters, gradients and optimizer state hold "
                f"{self.resident / _MIB:.2f} MiB and the tensors saved for the backward pass {before / _MIB:.2f} MiB"
            )
        return t

"""`infractl plan`: the fewest devices and nodes each way of training a run fits on, and which way
to train it.

For every scheme (ddp, zero1, zero2, fsdp) with and without activation checkpointing, at the
run's precision and in bf16, the search walks the device counts that split the global batch
(1 .. max nodes x devices per node) and keeps the first on which the budget (memory.budget) fits
one device. Tensor and pipeline parallel degrees are sized too, where the model divides, and
marked as not yet runnable by the trainer.

The recommendation follows the order a team should try: plain data parallel if it fits; then
shard the optimizer state, the gradients, the weights (zero1, zero2, fsdp); then activation
checkpointing and bf16 before more devices; tensor parallel when one layer does not fit, and
pipeline stages when the depth does not. Among the ways that fit on the fewest devices, the
first in that order is recommended (only ways the trainer runs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from infractl.config import RunSpec
from infractl.errors import UsageError
from infractl.planning import memory
from infractl.planning.devices import Device
from infractl.planning.memory import Budget

__all__ = ["Option", "Plan", "plan"]

Precision = Literal["fp32", "bf16"]


@dataclass(frozen=True)
class Option:
    """One way to train the run, and the fewest devices it fits on."""

    scheme: str  # ddp | zero1 | zero2 | fsdp | tp=K | pp=S
    checkpointing: bool
    precision: Precision
    runnable: bool
    devices: int | None  # None: fits on no device count within --max-nodes
    nodes: int | None
    budget: Budget  # per device, at ``devices`` (or at the most devices tried, when it fits nowhere)
    shortfall: int  # bytes the budget exceeds a device by at the most devices tried (0 when it fits)
    tried: int  # the device count ``budget`` is for

    @property
    def label(self) -> str:
        extras = [
            x for x, on in (("activation checkpointing", self.checkpointing), ("bf16", self.precision == "bf16")) if on
        ]
        return " + ".join([self.scheme, *extras])

    def to_dict(self) -> dict[str, Any]:
        return {
            "scheme": self.scheme,
            "activation_checkpointing": self.checkpointing,
            "mixed_precision": self.precision,
            "runnable": self.runnable,
            "devices": self.devices,
            "nodes": self.nodes,
            "budget": self.budget.to_dict(),
            "shortfall_bytes": self.shortfall,
        }


@dataclass(frozen=True)
class Plan:
    run: str
    device: Device
    devices_per_node: int
    max_nodes: int
    parameters: int
    options: list[Option] = field(default_factory=list)
    recommended: Option | None = None

    def staging_host_bytes(self, option: Option) -> int:
        """Host memory a node needs for asynchronous checkpoint staging: each rank's share of
        the weights and optimizer state, copied once more."""
        per_rank = option.budget.parameters + option.budget.optimizer
        return per_rank * min(self.devices_per_node, option.devices or self.devices_per_node)

    def to_dict(self) -> dict[str, Any]:
        rec = self.recommended
        return {
            "run": self.run,
            "device": self.device.name,
            "device_memory_bytes": self.device.memory_bytes,
            "devices_per_node": self.devices_per_node,
            "max_nodes": self.max_nodes,
            "parameters": self.parameters,
            "options": [o.to_dict() for o in self.options],
            "recommended": None
            if rec is None
            else rec.to_dict() | {"staging_host_bytes": self.staging_host_bytes(rec)},
        }


def _counts(batch_size: int, most: int) -> list[int]:
    """Device counts that split the global batch evenly, ascending."""
    return [n for n in range(1, most + 1) if batch_size % n == 0]


def _search(
    spec: RunSpec,
    device: Device,
    counts: list[int],
    per_node: int,
    *,
    scheme: memory.Scheme,
    checkpointing: bool,
    precision: Precision,
) -> Option:
    last: tuple[int, Budget] | None = None
    for n in counts:
        b = memory.budget(
            spec.model,
            scheme=scheme,
            ranks=n,
            micro_batch=spec.batch_size // n,
            precision=precision,
            checkpointing=checkpointing,
            cuda=device.cuda,
        )
        last = (n, b)
        if b.total <= device.memory_bytes:
            return Option(
                scheme, checkpointing, precision, scheme in memory.RUNNABLE, n, math.ceil(n / per_node), b, 0, n
            )
    assert last is not None
    n, b = last
    return Option(
        scheme, checkpointing, precision, scheme in memory.RUNNABLE, None, None, b, b.total - device.memory_bytes, n
    )


def _model_parallel(spec: RunSpec, device: Device, per_node: int, precision: Precision) -> list[Option]:
    """Tensor and pipeline parallel degrees the model divides into (up to one node's devices),
    at micro batch = the global batch (no data parallelism): not yet runnable by the trainer."""
    found = []
    base = memory.budget(
        spec.model,
        scheme="ddp",
        ranks=1,
        micro_batch=spec.batch_size,
        precision=precision,
        checkpointing=False,
        cuda=device.cuda,
    )
    blocks = spec.model.layers * memory.block_parameters(spec.model.hidden)
    block_share = blocks / memory.parameters(spec.model)
    for degree in range(2, per_node + 1):
        if spec.model.heads % degree == 0 and spec.model.hidden % degree == 0:
            # Blocks' weights, gradients, optimizer state and about 12 of 17 saved activations
            # per layer split over the degree; embeddings and norms stay whole.
            states = 1 - block_share + block_share / degree
            acts = 5 / 17 + 12 / (17 * degree)
            found.append(_scaled(f"tp={degree}", base, states, acts, device, degree, per_node, precision))
        if spec.model.layers % degree == 0:
            # Each stage holds its share of the blocks and their activations.
            states = 1 - block_share + block_share / degree
            found.append(_scaled(f"pp={degree}", base, states, 1 / degree, device, degree, per_node, precision))
    return found


def _scaled(
    scheme: str,
    base: Budget,
    states: float,
    acts: float,
    device: Device,
    degree: int,
    per_node: int,
    precision: Precision,
) -> Option:
    b = Budget(
        parameters=int(base.parameters * states),
        gradients=int(base.gradients * states),
        optimizer=int(base.optimizer * states),
        activations=int(base.activations * acts),
        temporary=int(base.temporary * states),
        fragmentation=int(base.fragmentation * acts),
        reserve=base.reserve,
    )
    fits = b.total <= device.memory_bytes
    return Option(
        scheme,
        False,
        precision,
        False,
        degree if fits else None,
        math.ceil(degree / per_node) if fits else None,
        b,
        0 if fits else b.total - device.memory_bytes,
        degree,
    )


def plan(spec: RunSpec, device: Device, *, devices_per_node: int, max_nodes: int) -> Plan:
    """Every option for ``spec`` on ``device``, and the recommended one (None: nothing fits)."""
    if devices_per_node < 1:
        raise UsageError(f"must be at least 1, got {devices_per_node}", field="--gpus-per-node")
    if max_nodes < 1:
        raise UsageError(f"must be at least 1, got {max_nodes}", field="--max-nodes")
    counts = _counts(spec.batch_size, devices_per_node * max_nodes)
    precisions: list[Precision] = [spec.mixed_precision]
    if spec.mixed_precision == "fp32":
        precisions.append("bf16")
    ordered: list[Option] = []
    for precision in precisions:
        for checkpointing in (False, True):
            for scheme in memory.SCHEMES:
                ordered.append(
                    _search(
                        spec,
                        device,
                        counts,
                        devices_per_node,
                        scheme=scheme,
                        checkpointing=checkpointing,
                        precision=precision,
                    )
                )
    options = ordered + _model_parallel(spec, device, devices_per_node, spec.mixed_precision)
    runnable = [o for o in ordered if o.runnable and o.devices is not None]
    fewest = min((o.devices for o in runnable if o.devices is not None), default=None)
    recommended = next((o for o in runnable if o.devices == fewest), None)
    return Plan(spec.name, device, devices_per_node, max_nodes, memory.parameters(spec.model), options, recommended)

"""`infractl plan`: the fewest devices and nodes each way of training a run fits on, and which way
to train it.

For every data-parallel scheme (ddp, zero1, zero2, fsdp) with and without activation
checkpointing, at the run's precision and in bf16, the search walks the device counts that split
the global batch (1 .. max nodes x devices per node) and keeps the first on which the budget
(memory.budget) fits one device. Tensor parallel degrees (up to one node's devices, dividing the
heads and the hidden size) and pipeline degrees (dividing the layers, into equal micro-batches:
``parallel.microbatches`` left at its default, pp, under 1f1b) are searched the same way at the
run's precision, without checkpointing, with plain data parallelism over the copies of the model.
zero2 is sized, not run by the trainer.

The recommendation follows the order a team should try: plain data parallel if it fits; then
shard the optimizer state, the gradients, the weights (zero1, zero2, fsdp); then activation
checkpointing and bf16 before more devices; tensor parallel when one layer does not fit, and
pipeline stages when the depth does not. Among the ways that fit on the fewest devices, the
first in that order is recommended (only ways the trainer runs), with the run.yaml settings
that select it.

Each pass holds a rank's whole share of the batch unless run.yaml's ``micro_batch`` caps it. When
no way the trainer runs fits within the devices that way, gradient accumulation is the last
resort: every such way but a pipeline's is sized with the largest passes that fit (fewer
sequences per pass hold fewer activations; the global batch stays), and the one whose passes
are largest is recommended, with the ``micro_batch`` that selects it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from infractl.config import RunSpec, even_passes, micro_batch
from infractl.errors import UsageError
from infractl.planning import memory
from infractl.planning.devices import CATALOG, Device
from infractl.planning.memory import Budget, ModelSplit

__all__ = [
    "Option",
    "Plan",
    "accumulating",
    "best_accumulating",
    "format_bytes",
    "plan",
    "refuse_unless_fits",
    "run_budget",
]

Precision = Literal["fp32", "bf16"]


@dataclass(frozen=True)
class Option:
    """One way to train the run, and the fewest devices it fits on."""

    scheme: str  # ddp | zero1 | zero2 | fsdp | tp=K | pp=S
    data_parallel: memory.Scheme  # how the model's copies share the batch (ddp under tp=K, pp=S)
    split: ModelSplit  # how one copy of the model is split over ranks
    checkpointing: bool
    precision: Precision
    runnable: bool
    devices: int | None  # None: fits on no device count within --max-nodes
    nodes: int | None
    budget: Budget  # per device, at ``devices`` (or at the most devices tried, when it fits nowhere)
    shortfall: int  # bytes the budget exceeds a device by at the most devices tried (0 when it fits)
    tried: int  # the device count ``budget`` is for
    micro_batch: int  # sequences per forward pass at ``tried`` devices
    share: int  # sequences per data-parallel rank and step at ``tried`` devices
    accumulates: bool = False
    """Searched with gradient accumulation: the largest micro-batch that fits (run.yaml's ``micro_batch``)."""

    @property
    def label(self) -> str:
        label = way_label(self.scheme, checkpointing=self.checkpointing, precision=self.precision)
        return f"{label} + gradient accumulation" if self.accumulates else label

    @property
    def accumulation(self) -> int:
        """Forward/backward passes per optimizer step (a pipeline's micro-batches are one step's)."""
        return 1 if self.split.pp > 1 else math.ceil(self.share / self.micro_batch)

    @property
    def settings(self) -> dict[str, Any]:
        """The run.yaml fields that select this way (``parallel`` is set: the trainer runs it).
        ``micro_batch``: this way's when it accumulates, unset for a pipeline (its micro-batches
        are ``parallel.microbatches``), else as run.yaml has it (the search sized that)."""
        assert self.parallel is not None
        found: dict[str, Any] = {
            "parallel": self.parallel,
            "activation_checkpointing": self.checkpointing,
            "mixed_precision": self.precision,
        }
        if self.accumulates or self.split.pp > 1:
            found["micro_batch"] = self.micro_batch if self.accumulates else None
        return found

    @property
    def parallel(self) -> str | dict[str, int] | None:
        """run.yaml's ``parallel`` for this way: a shorthand or a mesh; None if the trainer
        does not run it."""
        if self.split.tp > 1:
            return {"tp": self.split.tp}
        if self.split.pp > 1:
            return {"pp": self.split.pp}
        return self.data_parallel if self.runnable else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "scheme": self.scheme,
            "parallel": self.parallel,
            "activation_checkpointing": self.checkpointing,
            "mixed_precision": self.precision,
            "runnable": self.runnable,
            "devices": self.devices,
            "nodes": self.nodes,
            "budget": self.budget.to_dict(),
            "shortfall_bytes": self.shortfall,
            "micro_batch": self.micro_batch,
            "accumulation": self.accumulation,
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


@dataclass(frozen=True)
class _Way:
    """What the search sizes: a scheme over the model's copies, each split by ``split``."""

    scheme: str
    data_parallel: memory.Scheme
    split: ModelSplit
    checkpointing: bool
    precision: Precision


def _budget(spec: RunSpec, way: _Way, *, dp: int, micro: int, cuda: bool) -> Budget:
    return memory.budget(
        spec.model,
        scheme=way.data_parallel,
        ranks=dp,
        micro_batch=micro,
        precision=way.precision,
        checkpointing=way.checkpointing,
        cuda=cuda,
        split=way.split,
    )


def _option(way: _Way, device: Device, *, per_node: int, n: int, micro: int, share: int, b: Budget) -> Option:
    """``way`` sized on ``n`` devices: it fits on them if ``b`` fits one."""
    fits = b.total <= device.memory_bytes
    return Option(
        way.scheme,
        way.data_parallel,
        way.split,
        way.checkpointing,
        way.precision,
        way.data_parallel in memory.RUNNABLE,
        n if fits else None,
        math.ceil(n / per_node) if fits else None,
        b,
        0 if fits else b.total - device.memory_bytes,
        n,
        micro,
        share,
    )


def _search(spec: RunSpec, device: Device, way: _Way, *, per_node: int, most: int) -> Option | None:
    """The fewest devices (at most ``most``) ``way`` fits on, each pass of run.yaml's micro-batch
    (a pipeline's: its share over pp); None when no device count splits the global batch into
    its equal micro-batches."""
    split = way.split
    copy = split.tp * split.pp  # ranks per copy of the model
    last: Option | None = None
    for dp in range(1, most // copy + 1):
        if spec.batch_size % (dp * split.pp):
            continue
        share = spec.batch_size // dp
        # A pipeline's pp micro-batches of each share; else the share in passes of run.yaml's micro_batch.
        micro = share // split.pp if split.pp > 1 else even_passes(share, spec.micro_batch)
        b = _budget(spec, way, dp=dp, micro=micro, cuda=device.cuda)
        last = _option(way, device, per_node=per_node, n=dp * copy, micro=micro, share=share, b=b)
        if last.devices is not None:
            break
    return last


def accumulating(spec: RunSpec, device: Device, *, per_node: int, most: int) -> list[Option]:
    """Every runnable way but a pipeline's, with gradient accumulation: on the device count (at
    most ``most``) where its largest micro-batch that fits is largest (the fewest devices of
    those), that micro-batch, in passes as even as can be; ways that fit on none even one
    sequence a pass are left out. For a run no way fits whole: fewer sequences a pass hold fewer
    activations, and the global batch stays."""
    found = []
    for way in _ways(spec, per_node=per_node, most=most):
        if way.split.pp > 1 or way.data_parallel not in memory.RUNNABLE:
            continue
        best: Option | None = None
        for dp in range(1, most // way.split.tp + 1):
            if spec.batch_size % dp:
                continue
            share = spec.batch_size // dp
            largest = _largest_fitting(spec, device, way, dp=dp, share=share)
            if largest is None:
                continue
            micro = even_passes(share, largest)
            if best is None or micro > best.micro_batch:
                b = _budget(spec, way, dp=dp, micro=micro, cuda=device.cuda)
                best = _option(way, device, per_node=per_node, n=dp * way.split.tp, micro=micro, share=share, b=b)
        if best is not None:
            found.append(dataclasses.replace(best, accumulates=True))
    return found


def _largest_fitting(spec: RunSpec, device: Device, way: _Way, *, dp: int, share: int) -> int | None:
    """The most sequences a pass of ``way`` on ``dp`` data-parallel ranks may hold and fit (at
    most ``share``: the budget grows with the micro-batch); None when not even one fits."""

    def fits(micro: int) -> bool:
        return _budget(spec, way, dp=dp, micro=micro, cuda=device.cuda).total <= device.memory_bytes

    if not fits(1):
        return None
    low, high = 1, share
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle) else (low, middle - 1)
    return low


def best_accumulating(options: list[Option]) -> Option | None:
    """Of accumulating ways, the one whose passes are largest (the fewest of them, the most work
    per kernel), then on the fewest devices, then the first in the recommendation's order."""
    fitting = [o for o in options if o.devices is not None]
    return max(fitting, key=lambda o: (o.micro_batch, -(o.devices or 0)), default=None)


def _ways(spec: RunSpec, *, per_node: int, most: int) -> Iterator[_Way]:
    """Every way to size, in the order of the recommendation (the module docstring)."""
    precisions: list[Precision] = [spec.mixed_precision]
    if spec.mixed_precision == "fp32":
        precisions.append("bf16")
    for precision in precisions:
        for checkpointing in (False, True):
            for scheme in memory.SCHEMES:
                yield _Way(scheme, scheme, ModelSplit(), checkpointing, precision)
    model = spec.model
    for tp in range(2, per_node + 1):
        if model.heads % tp == 0 and model.hidden % tp == 0:
            yield _Way(f"tp={tp}", "ddp", ModelSplit(tp=tp), False, spec.mixed_precision)
    for pp in range(2, min(most, model.layers) + 1):
        if model.layers % pp == 0:
            # parallel.microbatches defaults to pp; 1f1b then holds all pp at the first stage.
            yield _Way(f"pp={pp}", "ddp", ModelSplit(pp=pp, held=pp), False, spec.mixed_precision)


def plan(spec: RunSpec, device: Device, *, devices_per_node: int, max_nodes: int) -> Plan:
    """Every option for ``spec`` on ``device``, and the recommended one (None: nothing fits)."""
    if devices_per_node < 1:
        raise UsageError(f"must be at least 1, got {devices_per_node}", field="--gpus-per-node")
    if max_nodes < 1:
        raise UsageError(f"must be at least 1, got {max_nodes}", field="--max-nodes")
    most = devices_per_node * max_nodes
    options = [
        option
        for way in _ways(spec, per_node=devices_per_node, most=most)
        if (option := _search(spec, device, way, per_node=devices_per_node, most=most)) is not None
    ]
    runnable = [o for o in options if o.runnable and o.devices is not None]
    fewest = min((o.devices for o in runnable if o.devices is not None), default=None)
    recommended = next((o for o in runnable if o.devices == fewest), None)
    if recommended is None:
        # No way fits a whole share per pass: the ways that fit with smaller passes join the options.
        accumulated = accumulating(spec, device, per_node=devices_per_node, most=most)
        options += accumulated
        recommended = best_accumulating(accumulated)
    return Plan(spec.name, device, devices_per_node, max_nodes, memory.parameters(spec.model), options, recommended)


def format_bytes(n: int) -> str:
    """``n`` bytes in the largest binary unit it reaches: ``1.50 GiB``, ``68.00 MiB``, ``12 B``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n} B"


def way_label(layout: str, *, checkpointing: bool, precision: str) -> str:
    """How a run trains, in one phrase: ``fsdp + activation checkpointing + bf16``."""
    extras = [x for x, on in (("activation checkpointing", checkpointing), ("bf16", precision == "bf16")) if on]
    return " + ".join([layout, *extras])


def spec_budget(spec: RunSpec, *, ranks: int, micro_batch: int, cuda: bool) -> Budget:
    """Bytes per device of ``spec`` as it is configured (its layout, precision and activation
    checkpointing) with ``ranks`` data-parallel ranks, each running ``micro_batch`` sequences
    per forward pass."""
    parallel = spec.parallel
    held = memory.held_microbatches(parallel.pp, parallel.n_microbatches, parallel.pp_schedule)
    way = _Way(
        parallel.label,
        parallel.scheme,
        ModelSplit(tp=parallel.tp, pp=parallel.pp, held=held),
        spec.activation_checkpointing,
        spec.mixed_precision,
    )
    return _budget(spec, way, dp=ranks, micro=micro_batch, cuda=cuda)


def run_budget(spec: RunSpec, *, world_size: int, max_world_size: int, cuda: bool) -> Budget:
    """:func:`spec_budget` on a world of ``world_size`` ranks, the micro-batch sized for
    ``max_world_size`` as the trainer sizes it."""
    return spec_budget(
        spec,
        ranks=spec.parallel.dp_degree(world_size),
        micro_batch=micro_batch(spec, world_size=world_size, max_world_size=max_world_size),
        cuda=cuda,
    )


def refuse_unless_fits(
    spec: RunSpec, device: Device, *, processes: int, nodes: tuple[int, int], cluster: str, file: str
) -> None:
    """``UsageError`` with the shortfall unless ``spec``, as configured, fits ``device`` at its
    smallest world: ``nodes`` (the fewest and the most it may run on) of ``processes`` ranks. The
    smallest world holds the most per device (larger shards; a pipeline's larger micro-batches),
    and an elastic run shrinks to it when nodes fail."""
    fewest, most = nodes
    budget = run_budget(spec, world_size=fewest * processes, max_world_size=most * processes, cuda=device.cuda)
    if budget.total <= device.memory_bytes:
        return
    way = way_label(spec.parallel.label, checkpointing=spec.activation_checkpointing, precision=spec.mixed_precision)
    sized = f" --device {device.name}" if device.name in CATALOG else ""
    raise UsageError(
        f"run {spec.name!r} does not fit the devices of cluster {cluster!r}: as configured ({way}) it needs "
        f"{format_bytes(budget.total)} per device on its smallest world ({fewest} node(s) x {processes} "
        f"process(es), nodes.min), {format_bytes(budget.total - device.memory_bytes)} more than the "
        f"{format_bytes(device.memory_bytes)} of a {device.name} device; `infractl plan {file}{sized} "
        f"--gpus-per-node {processes} --max-nodes {most}` shows the ways that fit (--apply writes the first)",
        file=file,
    )

"""A run that went through faults against an uninterrupted reference run of the same spec: did the
faults change what was trained?

Per step, the run's loss is the one of the step's newest record (``read_metrics``: a step trained
again after a resume counts as retrained), so the losses compared are those of the steps the final
weights descend from. A deterministic run (``deterministic: true``) resumed on the world size it
had repeats every bit, so every step trained on the reference's world size before the first step
trained on another must match bit for bit. From that first step on, the float32 sums differ in
their order (one rank accumulating where two all-reduce) and the rounding compounds through AdamW:
those steps, and the final weights then (as a whole: ``_weights``), must match within
``CROSS_WORLD_REL_TOL`` (relative).
When the world size never changed, the final weights must be bitwise equal too.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from infractl import runstore
from infractl.errors import StateError
from infractl.runstore import StepRecord
from infractl.store import Store

__all__ = ["CROSS_WORLD_REL_TOL", "Comparison", "compare_runs", "lineage_world_change"]

#: Largest relative difference allowed, per step's loss and over the final weights (``_weights``),
#: once a step was trained on another world size. Measured for a resume on another world size
#: (tests/test_schemes.py, tests/test_chaos.py): 1.1e-7 per step's loss, 4e-8 over the weights.
CROSS_WORLD_REL_TOL = 1e-5

#: How many of the steps over their tolerance a comparison names.
_NAMED = 10


@dataclass(frozen=True)
class Comparison:
    """The run against its reference (``Comparison.matches`` is the verdict)."""

    run_id: str
    reference: str
    steps: int  # steps compared: every step of both runs
    world_size: int  # the reference's
    first_other_world_step: int | None  # the run's first step trained on another world size
    bitwise_steps: int  # steps compared bit for bit (those before it)
    max_loss_rel_diff: float  # over every step
    mismatched_steps: list[int]  # steps over their tolerance (the first few)
    weights_bitwise: bool
    weights_rel_diff: float  # over the whole model (``_weights``)
    weights_tolerance: float  # 0.0: bitwise required

    @property
    def matches(self) -> bool:
        weights_ok = self.weights_bitwise or self.weights_rel_diff <= self.weights_tolerance
        return not self.mismatched_steps and weights_ok

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"matches": self.matches}


def lineage_world_change(records: list[StepRecord], world_size: int) -> int | None:
    """The first step of ``records`` trained on a world size other than ``world_size``."""
    return next((int(r["step"]) for r in records if int(r["world_size"]) != world_size), None)


def compare_runs(store: Store, run_id: str, reference: str) -> Comparison:
    """Compare the finished runs ``run_id`` and ``reference`` (the same spec but its name):
    per-step losses and the final committed weights, by the rules of the module docstring.
    ``StateError`` when either run lacks a step the other has."""
    ours, theirs = runstore.read_metrics(store, run_id), runstore.read_metrics(store, reference)
    steps = [int(r["step"]) for r in theirs]
    if [int(r["step"]) for r in ours] != steps or not steps:
        raise StateError(
            f"runs {run_id!r} and {reference!r} did not record the same steps ({len(ours)} and {len(theirs)} "
            "records): compare finished runs of one spec"
        )
    world_size = int(theirs[0]["world_size"])
    changed = lineage_world_change(ours, world_size)
    mismatched: list[int] = []
    worst = 0.0
    for mine, ref in zip(ours, theirs, strict=True):
        step, a, b = int(ref["step"]), float(mine["loss"]), float(ref["loss"])
        diff = _relative(abs(a - b), abs(b))
        worst = max(worst, diff)
        exact = changed is None or step < changed
        if (a != b) if exact else diff > CROSS_WORLD_REL_TOL:
            mismatched.append(step)
    bitwise, weights_diff = _weights(store, run_id, reference)
    return Comparison(
        run_id=run_id,
        reference=reference,
        steps=len(steps),
        world_size=world_size,
        first_other_world_step=changed,
        bitwise_steps=len(steps) if changed is None else sum(1 for s in steps if s < changed),
        max_loss_rel_diff=worst,
        mismatched_steps=mismatched[:_NAMED],
        weights_bitwise=bitwise,
        weights_rel_diff=weights_diff,
        weights_tolerance=0.0 if changed is None else CROSS_WORLD_REL_TOL,
    )


def _weights(store: Store, run_id: str, reference: str) -> tuple[bool, float]:
    """Whether the two runs' newest committed weights are bitwise equal, and their relative
    difference over the whole model: the L2 norm of the difference over that of the reference's
    weights. (Per tensor it would mean nothing for a tensor whose gradient is zero by symmetry,
    an attention key's bias: its values are float noise around 0, and any difference is large
    beside them.)"""
    # torch and the model load only here: every other drill command starts without them.
    import torch

    from infractl.model.export import consolidate

    with consolidate(store, run_id) as ours, consolidate(store, reference) as theirs:
        mine, ref = ours.weights(), theirs.weights()
    if mine.keys() != ref.keys():
        raise StateError(f"runs {run_id!r} and {reference!r} have different parameters: compare runs of one spec")
    bitwise, squared_diff, squared = True, 0.0, 0.0
    for name, tensor in ref.items():
        other = mine[name]
        bitwise = bitwise and torch.equal(other, tensor)
        squared_diff += float((other.double() - tensor.double()).square().sum())
        squared += float(tensor.double().square().sum())
    return bitwise, _relative(math.sqrt(squared_diff), math.sqrt(squared))


def _relative(diff: float, magnitude: float) -> float:
    return diff / magnitude if magnitude > 0 else diff

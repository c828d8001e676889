"""The device catalog `infractl plan` sizes against: memory per device, and peak bf16 FLOP/s.

Memory is the datasheet's (GB of HBM as the vendor counts it, 10^9 bytes); the budget itself
holds back the runtime's reserve and a fragmentation margin. ``cpu`` is this machine: its
physical memory, one "device" per training process; or, with ``$INFRACTL_DEVICE_MEMORY``, an
emulated device of that many bytes per process, which the trainer enforces (trainer/held.py):
rehearse a device's memory limit, and running out of it, on CPU nodes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import psutil

from infractl.errors import UsageError

__all__ = ["Device", "CATALOG", "EMULATED_MEMORY_ENV", "device", "emulated_memory", "shared_cpu"]


@dataclass(frozen=True)
class Device:
    name: str
    memory_bytes: int
    peak_bf16_flops: float | None  # dense, without sparsity; None for the CPU
    cuda: bool


_GB = 10**9

#: Bytes of the emulated device a CPU training process has (the module docstring).
EMULATED_MEMORY_ENV = "INFRACTL_DEVICE_MEMORY"

CATALOG: dict[str, Device] = {
    d.name: d
    for d in (
        Device("a100-40gb", 40 * _GB, 312e12, True),
        Device("a100-80gb", 80 * _GB, 312e12, True),
        Device("h100-80gb", 80 * _GB, 989e12, True),
        Device("h200", 141 * _GB, 989e12, True),
        Device("b200", 180 * _GB, 2250e12, True),
        Device("l40s", 48 * _GB, 362e12, True),
    )
}


def emulated_memory(environ: Mapping[str, str]) -> int | None:
    """The emulated device's bytes in ``environ`` (None: no emulation); ``UsageError`` naming the
    variable when it is not a positive whole number."""
    value = environ.get(EMULATED_MEMORY_ENV)
    if value is None:
        return None
    if not value.isdigit() or int(value) < 1:
        raise UsageError(f"must be a positive number of bytes, got {value!r}", field=f"${EMULATED_MEMORY_ENV}")
    return int(value)


def device(name: str, environ: Mapping[str, str] | None = None) -> Device:
    """The catalog's device ``name`` (``cpu``: this machine's memory, or the emulated device
    ``environ`` sets); ``UsageError`` otherwise."""
    if name == "cpu":
        emulated = emulated_memory(environ or {})
        if emulated is not None:
            return Device("cpu (emulated)", emulated, None, False)
        return Device("cpu", int(psutil.virtual_memory().total), None, False)
    if name not in CATALOG:
        raise UsageError(f"unknown device {name!r} (one of: cpu, {', '.join(CATALOG)})", field="--device")
    return CATALOG[name]


def shared_cpu(ranks: int, environ: Mapping[str, str]) -> Device:
    """The device of each of ``ranks`` training processes that share this machine: its memory
    split evenly between them, or the emulated device ``environ`` sets (one per process)."""
    chosen = device("cpu", environ)
    if chosen.name == "cpu":
        return Device("cpu", chosen.memory_bytes // ranks, None, False)
    return chosen

"""The device catalog `infractl plan` sizes against: memory per device, and peak bf16 FLOP/s.

Memory is the datasheet's (GB of HBM as the vendor counts it, 10^9 bytes); the budget itself
holds back the runtime's reserve and a fragmentation margin. ``cpu`` is this machine: its
physical memory, one "device" per training process.
"""

from __future__ import annotations

from dataclasses import dataclass

import psutil

from infractl.errors import UsageError

__all__ = ["Device", "CATALOG", "device"]


@dataclass(frozen=True)
class Device:
    name: str
    memory_bytes: int
    peak_bf16_flops: float | None  # dense, without sparsity; None for the CPU
    cuda: bool


_GB = 10**9

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


def device(name: str) -> Device:
    """The catalog's device ``name`` (``cpu``: this machine's memory); ``UsageError`` otherwise."""
    if name == "cpu":
        return Device("cpu", int(psutil.virtual_memory().total), None, False)
    if name not in CATALOG:
        raise UsageError(f"unknown device {name!r} (one of: cpu, {', '.join(CATALOG)})", field="--device")
    return CATALOG[name]

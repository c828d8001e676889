"""Print, as one JSON object, the node's NVIDIA GPUs and EFA devices as the PCI bus and the RDMA stack
see them (read-only, Linux):

    {"gpus": ["0000:53:00.0", ...], "efa": ["0000:4f:00.0", ...], "rdma": {"rdmap79s0": "0000:4f:00.0", ...}}

``gpus``: NVIDIA GPUs on the PCI bus, which nvidia-smi should all see. ``efa``: the EFA functions on the
PCI bus, one per EFA interface attached to the instance. ``rdma``: the RDMA devices the efa driver
registered for them, by PCI function: what libfabric, and through it NCCL, can use.

The argument is the sysfs mount point (default /sys).
"""

import json
import sys
from pathlib import Path

NVIDIA = "0x10de"
AMAZON = "0x1d0f"
# VGA (0x0300) and 3D (0x0302) controllers; NVSwitches are bridges (0x0680) and stay out.
GPU_CLASSES = ("0x0300", "0x0302")
# Amazon's EFA generations are device ids 0xefa0..0xefa3; its ENA (plain Ethernet) ids are 0xec2x.
EFA_DEVICE_PREFIX = "0xefa"


def _read(path: Path) -> str:
    return path.read_text().strip()


def devices(sysfs: Path) -> dict[str, object]:
    gpus: list[str] = []
    efa: list[str] = []
    for function in sorted((sysfs / "bus" / "pci" / "devices").iterdir()):
        vendor = _read(function / "vendor")
        if vendor == NVIDIA and _read(function / "class").startswith(GPU_CLASSES):
            gpus.append(function.name)
        elif vendor == AMAZON and _read(function / "device").startswith(EFA_DEVICE_PREFIX):
            efa.append(function.name)
    rdma: dict[str, str] = {}
    infiniband = sysfs / "class" / "infiniband"
    if infiniband.is_dir():
        for device in sorted(infiniband.iterdir()):
            address = (device / "device").resolve().name
            if address in efa:
                rdma[device.name] = address
    return {"gpus": gpus, "efa": efa, "rdma": rdma}


if __name__ == "__main__":
    print(json.dumps(devices(Path(sys.argv[1] if len(sys.argv) > 1 else "/sys"))))

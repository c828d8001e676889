"""What ``infractl export`` costs in host memory: ``python tests/export_memory.py STORE RUN OUT``
exports the run's newest committed step in each format (infractl/model/export.py, the functions
the command runs) while a sampler records the peak of this process's anonymous resident memory
(trainer/memprobe.py), and prints ``{"baseline": B, "safetensors": P, "torch": P}``: the
resident bytes before, and the peak of each export.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from infractl.model.export import FORMATS, consolidate, export
from infractl.store import open_store
from trainer import memprobe


def main(store_uri: str, run_id: str, out: Path) -> None:
    store = open_store(store_uri)
    report = {"baseline": memprobe.start()}
    with consolidate(store, run_id) as model:  # downloaded and checked once, then read by each export
        for fmt in FORMATS:
            with memprobe.PeakSampler() as sampler:
                export(model, out / f"model.{fmt}", fmt=fmt)
            report[fmt] = sampler.peak
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], Path(sys.argv[3]))

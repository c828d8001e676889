"""The bench's baseline in the store: ``bench/<id>/baseline.json`` beside its two plots."""

from __future__ import annotations

import json
from typing import Any

from infractl import runstore
from infractl.store import Store

__all__ = ["write_baseline"]


def write_baseline(store: Store, baseline: dict[str, Any]) -> dict[str, str]:
    """Put ``baseline.json`` and its two plots in the store; return each one's key."""
    from infractl.scaling import plots  # matplotlib: loaded only when there is something to draw

    prefix = runstore.bench_prefix(baseline["bench_id"])
    keys = {
        "baseline": f"{prefix}/baseline.json",
        "throughput_plot": f"{prefix}/throughput.png",
        "split_plot": f"{prefix}/split.png",
    }
    baseline["plots"] = {"throughput": keys["throughput_plot"], "split": keys["split_plot"]}
    store.put_bytes(keys["throughput_plot"], plots.throughput_png(baseline))
    store.put_bytes(keys["split_plot"], plots.split_png(baseline))
    store.put_bytes(keys["baseline"], json.dumps(baseline, indent=1).encode())
    return keys

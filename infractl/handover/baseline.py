"""The bundle's baseline/: what normal looks like, so the team can tell a regression from noise.

Per run: step time, tokens/s, the step-time split and peak memory (medians over the steps of its
latest attempt), its drills (``runs/<run>/drills/``) and chaos series (``runs/<run>/chaos/``), and
the loss and validation-loss curves; from the newest ``infractl bench`` of the cluster, the scaling
figures and plots. JSON plus PNG."""

from __future__ import annotations

import io
import json
import statistics
from typing import Any

from infractl import runstore
from infractl.runstore import RunRecord, StepRecord
from infractl.store import Store

__all__ = ["newest_bench", "run_baseline", "loss_plot"]

_SPLIT = ("data_s", "forward_backward_s", "optimizer_s", "comm_s", "checkpoint_blocking_s")


def newest_bench(store: Store, cluster: str) -> tuple[dict[str, Any], dict[str, bytes]] | None:
    """The newest bench baseline of ``cluster`` and its plots (file name -> PNG), if any."""
    ids = sorted({o.key.split("/")[1] for o in store.list("bench/") if o.key.endswith("/baseline.json")})
    for bench_id in reversed(ids):
        prefix = runstore.bench_prefix(bench_id)
        baseline = json.loads(store.get_bytes(f"{prefix}/baseline.json"))
        if baseline.get("cluster") == cluster:
            plots = {
                o.key.rsplit("/", 1)[1]: store.get_bytes(o.key)
                for o in store.list(prefix + "/")
                if o.key.endswith(".png")
            }
            return baseline, plots
    return None


def _median(records: list[StepRecord], field: str) -> float | None:
    rows: list[dict[str, Any]] = [dict(r) for r in records]
    values = [float(r[field]) for r in rows if r.get(field) is not None]
    return round(statistics.median(values), 6) if values else None


def run_baseline(store: Store, record: RunRecord, records: list[StepRecord]) -> dict[str, Any]:
    """The figures of one run (see the module docstring); ``records``: its metrics (``read_metrics``)."""
    attempt = record.last_attempt
    latest = [r for r in records if attempt is not None and r["attempt"] == attempt.attempt] or records
    return {
        "run": record.run_id,
        "steps_recorded": len(records),
        "last_step": records[-1]["step"] if records else None,
        "last_committed_step": runstore.latest_committed_step(store, record.run_id),
        "world_size": latest[-1]["world_size"] if latest else None,
        "median_step_time_s": _median(latest, "step_time_s"),
        "median_tokens_per_s": _median(latest, "tokens_per_s"),
        "median_split_s": {f: _median(latest, f) for f in _SPLIT},
        "peak_memory_bytes": max((r["peak_memory_bytes"] for r in latest), default=None),
        "final_loss": records[-1]["loss"] if records else None,
        "val_loss": [[r["step"], r["val_loss"]] for r in records if "val_loss" in r],
        "drills": [d.to_dict() for d in runstore.read_drill_records(store, record.run_id)],
        "chaos": [c.to_dict() for c in runstore.read_chaos_records(store, record.run_id)],
    }


def loss_plot(run_id: str, records: list[StepRecord]) -> bytes | None:
    """The run's loss (and validation loss) against step from its metrics, as a PNG; None without any."""
    if not records:
        return None
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot([r["step"] for r in records], [r["loss"] for r in records], label="training loss", linewidth=1)
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    if val:
        ax.plot(*zip(*val, strict=True), "o-", label="validation loss")
    ax.set(xlabel="step", ylabel="loss (nats per byte)", title=f"run {run_id}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    buffer = io.BytesIO()
    # No metadata: the same metrics draw the same bytes (the bundle is deterministic).
    fig.savefig(buffer, format="png", metadata={"Software": None})
    plt.close(fig)
    return buffer.getvalue()

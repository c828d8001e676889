"""The bench's two plots, as PNG bytes: throughput and efficiency against nodes, and the
step-time split of each count. Drawn on matplotlib's Agg canvas (no display, no pyplot state)."""

from __future__ import annotations

import io
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from infractl.scaling.bench import SHARES

__all__ = ["throughput_png", "split_png"]

_COLORS = {
    "data_wait": "#e69f00",
    "compute": "#0072b2",
    "exposed_comm": "#d55e00",
    "optimizer": "#009e73",
    "checkpoint_blocking": "#cc79a7",
    "between_steps": "#999999",
}


def _png(figure: Figure) -> bytes:
    FigureCanvasAgg(figure)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100)
    return buffer.getvalue()


def _title(baseline: dict[str, Any]) -> str:
    return f"{baseline['run']} ({baseline['parallel']}, {baseline['scaling']} scaling), bench {baseline['bench_id']}"


def throughput_png(baseline: dict[str, Any]) -> bytes:
    """Tokens/s against nodes beside linear scaling from the smallest count; efficiency against
    nodes with the 80% line."""
    results = baseline["results"]
    nodes = [r["nodes"] for r in results]
    tokens = [r["tokens_per_s"] for r in results]
    ideal = [tokens[0] * n / nodes[0] for n in nodes]
    figure = Figure(figsize=(10, 4.2), layout="constrained")
    figure.suptitle(_title(baseline))
    left, right = figure.subplots(1, 2)
    left.plot(nodes, tokens, marker="o", label="measured")
    left.plot(nodes, ideal, linestyle="--", color="grey", label="linear from the smallest count")
    left.set(xlabel="nodes", ylabel="tokens/s", xticks=nodes, title="throughput")
    left.set_ylim(bottom=0)
    left.legend()
    right.plot(nodes, [100 * r["efficiency"] for r in results], marker="o")
    right.axhline(80, linestyle="--", color="grey", label="80%")
    right.set(xlabel="nodes", ylabel="scaling efficiency (%)", xticks=nodes, title="efficiency")
    right.set_ylim(0, max(110, *(105 * r["efficiency"] for r in results)))
    right.legend()
    return _png(figure)


def split_png(baseline: dict[str, Any]) -> bytes:
    """One stacked bar per count: the shares of its step time (a part not measured is left out
    and named in the legend)."""
    results = baseline["results"]
    labels = [f"{r['nodes']} node(s)" for r in results]
    figure = Figure(figsize=(7, 4.5), layout="constrained")
    figure.suptitle(_title(baseline))
    axes = figure.subplots()
    bottom = [0.0] * len(results)
    for part, label in SHARES.items():
        shares = [r["shares"][part] for r in results]
        if any(s is None for s in shares):
            label += " (not measured)"
        values = [100 * (s or 0.0) for s in shares]
        axes.bar(labels, values, bottom=bottom, label=label, color=_COLORS[part])
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    axes.set(ylabel="share of a step's wall time (%)", ylim=(0, 100), title="where the step time goes")
    handles, names = axes.get_legend_handles_labels()
    axes.legend(handles[::-1], names[::-1], loc="upper left", bbox_to_anchor=(1.0, 1.0))  # as stacked: top first
    return _png(figure)

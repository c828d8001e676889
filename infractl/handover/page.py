"""The bundle's index.html and style.css: one static page that shows the bundle (the topology
drawing, each run's headline figures and loss curve, the scaling benchmark's figures and plots,
the runbooks by title, the cluster's config) and links every file of it. It opens from disk (no
server) and names no external URL: the style sheet, the images and the links are relative paths.

The skeleton and the style are the repository's ``bundle/index.html`` (``string.Template`` text,
placeholders listed in ``bundle/README.md``) and ``bundle/style.css``, copied as is. This module
renders the HTML that fills each placeholder from the bundle's own files, so the page shows what
the bundle holds, and the same files give the same bytes. ``scripts/screenshot_bundle.py`` opens
the page in headless Chromium (tests/test_bundle.py, and the README's docs/bundle.png)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from html import escape
from pathlib import Path
from string import Template
from typing import Any
from urllib.parse import quote

from infractl import templates
from infractl.handover.reference import RUNBOOKS

__all__ = ["render", "template_dir"]

_NONE = '<span class="muted">none</span>'

#: Captions of the bench's plots (``baseline/bench-<name>``); another plot is captioned by its name.
_BENCH_PLOTS = {
    "bench-throughput.png": "Tokens/s and scaling efficiency against the node count.",
    "bench-split.png": "Where a step's wall time goes at each node count.",
}
_RUN_HEADERS = ("run", "committed step", "world size", "step time", "tokens/s", "peak memory", "final loss",
                "validation loss", "drills", "files")  # fmt: skip
#: The step-time split of baseline/<run>.json (baseline.run_baseline), in the order a step spends it.
_SPLIT = {
    "data_s": "data",
    "forward_backward_s": "forward + backward",
    "comm_s": "communication",
    "optimizer_s": "optimizer",
    "checkpoint_blocking_s": "checkpoint (blocking)",
}
_CHAOS_HEADERS = ("run", "seed", "recovered", "median restart", "worst restart", "steps lost", "against the reference")
_DRILL_HEADERS = ("run", "drill", "node", "outcome", "detected", "restarted", "steps lost", "world after")
_BENCH_HEADERS = ("nodes", "ranks", "global batch", "step time", "tokens/s", "speedup", "efficiency", "idle cause")


def template_dir() -> Path:
    """``bundle/`` as infractl ships it."""
    return templates.folder("bundle")


def render(cluster: str, run_ids: list[str], files: Mapping[str, bytes]) -> dict[str, bytes]:
    """``index.html`` and ``style.css`` for a bundle of ``files`` (relative path -> content) and
    its runs ``run_ids``: the page links every one of those files, and ``style.css``."""
    style = (template_dir() / "style.css").read_bytes()
    values = {
        "cluster": escape(cluster),
        "run_names": ", ".join(_code(r) for r in run_ids) or "none yet",
        "topology": _topology(files),
        "baselines": _baselines(files, run_ids),
        "bench": _bench(files),
        "runbooks": _runbooks(files),
        "configs": _configs(files),
        "access": _access(files),
        "reference": _reference(files),
        "files": _every_file({**files, "style.css": style}),
    }
    page = Template((template_dir() / "index.html").read_text()).substitute(values)
    return {"index.html": page.encode(), "style.css": style}


def _code(text: str) -> str:
    return f"<code>{escape(text)}</code>"


def _inline(markdown: str) -> str:
    """One line of Markdown as HTML: its `code` spans as code, everything else as text."""
    return "".join(_code(part) if i % 2 else escape(part) for i, part in enumerate(markdown.split("`")))


def _link(path: str, html: str | None = None) -> str:
    return f'<a href="{escape(quote(path))}">{_code(path) if html is None else html}</a>'


def _figure(path: str, caption: str) -> str:
    return (
        f'<figure><a href="{escape(quote(path))}"><img src="{escape(quote(path))}" alt="{escape(caption)}"></a>'
        f"<figcaption>{escape(caption)} ({_code(path)})</figcaption></figure>"
    )


def _file_list(paths: list[str], files: Mapping[str, bytes] | None = None) -> str:
    """A list of links to ``paths``, with each one's size when ``files`` is given."""
    items = [f"<li>{_link(p)}{'' if files is None else _size(len(files[p]))}</li>" for p in paths]
    return '<ul class="files">' + "".join(items) + "</ul>"


def _size(length: int) -> str:
    size = f"{length / 1024:,.1f} KiB" if length >= 1024 else f"{length} B"
    return f' <span class="muted">{size}</span>'


def _title(content: bytes, fallback: str) -> str:
    """The text of a Markdown file's first ``# `` heading, as HTML."""
    heading = next((line[2:] for line in content.decode().splitlines() if line.startswith("# ")), fallback)
    return _inline(heading)


def _summary(content: bytes) -> str:
    """The first sentence of a Markdown file's first paragraph after its heading, as HTML."""
    lines = content.decode().splitlines()
    start = next((i + 1 for i, line in enumerate(lines) if line.startswith("# ")), 0)
    paragraph: list[str] = []
    for line in lines[start:]:
        if line.strip():
            paragraph.append(line.strip())
        elif paragraph:
            break
    text = " ".join(paragraph)
    sentence = re.match(r"(.+?\.)(?=\s+[A-Z]|$)", text)
    return _inline(sentence.group(1) if sentence else text)


def _topology(files: Mapping[str, bytes]) -> str:
    facts = [line[2:] for line in files["topology.md"].decode().splitlines() if line.startswith("- ")]
    return (
        '<div class="columns">'
        + _figure("topology.svg", "The nodes and their ranks, the rendezvous endpoint and the store.")
        + "<div><ul>"
        + "".join(f"<li>{_inline(fact)}</li>" for fact in facts)
        + f"</ul><p>Each node's address, ranks, collective interface and work directory, and how to grow the "
        f"cluster: {_link('topology.md')}.</p></div></div>"
    )


def _seconds(value: float | None) -> str:
    if value is None:
        return _NONE
    if value >= 1:
        return f"{value:,.2f} s"
    return f"{value * 1000:.2f} ms" if value < 0.01 else f"{value * 1000:.1f} ms"


def _number(value: float | None, spec: str, unit: str = "") -> str:
    return _NONE if value is None else f"{value:{spec}}{unit}"


def _row(*cells: str) -> str:
    return "<tr>" + "".join(f"<td>{cell}</td>" for cell in cells) + "</tr>"


def _table(headers: tuple[str, ...], rows: list[str]) -> str:
    return "<table><tr>" + "".join(f"<th>{escape(h)}</th>" for h in headers) + "</tr>" + "".join(rows) + "</table>"


def _baselines(files: Mapping[str, bytes], run_ids: list[str]) -> str:
    figures = {r: json.loads(files[f"baseline/{r}.json"]) for r in run_ids if f"baseline/{r}.json" in files}
    if not figures:
        return '<p class="muted">No run yet: regenerate the bundle after <code>infractl train</code>.</p>'
    headline = _table(_RUN_HEADERS, [_run_row(run, f, files) for run, f in figures.items()])
    split = _table(
        ("run", *_SPLIT.values()),
        [_row(_code(run), *(_seconds(f["median_split_s"].get(key)) for key in _SPLIT)) for run, f in figures.items()],
    )
    drills = [_drill_row(run, d) for run, f in figures.items() for d in f["drills"]]
    chaos = [_chaos_row(run, c) for run, f in figures.items() for c in f.get("chaos", [])]
    plots = [
        _figure(f"baseline/{run}-loss.png", f"Run {run}: training and validation loss against the step.")
        for run in figures
        if f"baseline/{run}-loss.png" in files
    ]
    return (
        headline
        + "<h3>Where a step's time goes (medians)</h3>"
        + split
        + ("<h3>Fault drills</h3>" + _table(_DRILL_HEADERS, drills) if drills else "")
        + ("<h3>Chaos series</h3>" + _table(_CHAOS_HEADERS, chaos) if chaos else "")
        + f'<div class="plots">{"".join(plots)}</div>'
    )


def _run_row(run: str, figures: dict[str, Any], files: Mapping[str, bytes]) -> str:
    val_loss = figures["val_loss"][-1][1] if figures["val_loss"] else None
    drills = figures["drills"]
    recovered = sum(d["outcome"] == "recovered" for d in drills)
    own = [
        (f"baseline/{run}.json", "figures"),
        (f"configs/runs/{run}.yaml", "run.yaml"),
        (f"configs/runs/{run}.environment.json", "environment"),
        (f"baseline/{run}-memory.json", "measured memory"),
    ]
    return _row(
        _code(run),
        _number(figures["last_committed_step"], "d"),
        _number(figures["world_size"], "d"),
        _seconds(figures["median_step_time_s"]),
        _number(figures["median_tokens_per_s"], ",.0f"),
        _number(None if figures["peak_memory_bytes"] is None else figures["peak_memory_bytes"] / 2**20, ",.0f", " MiB"),
        _number(figures["final_loss"], ".4f"),
        _number(val_loss, ".4f"),
        f"{len(drills)}, {recovered} recovered" if drills else _NONE,
        " · ".join(_link(path, escape(text)) for path, text in own if path in files),
    )


def _drill_row(run: str, drill: dict[str, Any]) -> str:
    return _row(
        _code(run),
        escape(drill["drill"]),
        escape(drill["node"] or "-"),
        escape(drill["outcome"] + (f", {drill['outcome_note']}" if drill.get("outcome_note") else "")),
        _seconds(drill["detect_s"]),
        _seconds(drill["restart_s"]),
        _number(drill["lost_work_steps"], "d"),
        _number(drill["world_size_after"], "d"),
    )


def _chaos_row(run: str, series: dict[str, Any]) -> str:
    comparison = series["comparison"]
    if comparison is None:
        against = escape(f"not compared: {series['stopped']}" if series["stopped"] else "not compared")
    else:
        verdict = "matches" if comparison["matches"] else "does not match"
        against = escape(
            f"{verdict} {comparison['reference']}: {comparison['bitwise_steps']}/{comparison['steps']} steps bitwise, "
            f"largest loss difference {comparison['max_loss_rel_diff']:.1e}"
        )
    return _row(
        _code(run),
        _number(series["seed"], "d"),
        f"{series['recovered']}/{series['count']}",
        _seconds(series["median_restart_s"]),
        _seconds(series["worst_restart_s"]),
        _number(series["lost_steps"], "d"),
        against,
    )


def _bench(files: Mapping[str, bytes]) -> str:
    if "baseline/bench.json" not in files:
        return (
            '<p class="muted">No benchmark yet: run <code>infractl bench RUN.yaml --nodes 1,2</code> on this '
            "cluster and regenerate the bundle.</p>"
        )
    bench = json.loads(files["baseline/bench.json"])
    largest = bench["results"][-1]
    labels = (f"tokens/s on {largest['nodes']} node(s)", "speedup over the smallest count", "scaling efficiency",
              "dominant idle cause")  # fmt: skip
    cards = zip(_scaling(largest), labels, strict=True)
    rows = [
        _row(*map(str, (r["nodes"], r["ranks"], r["global_batch"])), _seconds(r["median_step_time_s"]), *_scaling(r))
        for r in bench["results"]
    ]
    plots = [
        _figure(path, _BENCH_PLOTS.get(path.removeprefix("baseline/"), path))
        for path in sorted(files)
        if path.startswith("baseline/bench-") and path.endswith(".png")
    ]
    return (
        f"<p>Benchmark {_code(bench['bench_id'])}: {escape(bench['scaling'])} scaling of run {_code(bench['run'])} "
        f"({escape(bench['parallel'])}, {escape(bench['mixed_precision'])}), {bench['steps']} steps per count; "
        f"{escape(bench['batch_rule'])}. Every figure: {_link('baseline/bench.json')}.</p>"
        + '<div class="headline">'
        + "".join(f'<div class="figure"><b>{value}</b><span>{label}</span></div>' for value, label in cards)
        + "</div>"
        + _table(_BENCH_HEADERS, rows)
        + f'<div class="plots">{"".join(plots)}</div>'
    )


def _scaling(result: dict[str, Any]) -> tuple[str, str, str, str]:
    """A bench count's tokens/s, speedup, efficiency and dominant idle cause, as shown."""
    return (
        f"{result['tokens_per_s']:,.0f}",
        f"{result['speedup']:.2f}×",
        f"{result['efficiency']:.0%}",
        escape(result["dominant_idle_cause"].replace("_", " ")),
    )


def _runbooks(files: Mapping[str, bytes]) -> str:
    def order(path: str) -> tuple[int, str]:
        name = path.removeprefix("runbooks/").removesuffix(".md")
        return (RUNBOOKS.index(name) if name in RUNBOOKS else len(RUNBOOKS), name)

    paths = sorted((f for f in files if f.startswith("runbooks/")), key=order)
    items = [f"<li>{_link(p, _title(files[p], p))}<p>{_summary(files[p])}</p></li>" for p in paths]
    return '<ul class="cards">' + "".join(items) + "</ul>"


def _configs(files: Mapping[str, bytes]) -> str:
    readme, cluster = "configs/README.md", "configs/cluster.yaml"
    return (
        '<div class="columns"><div>'
        + f"<p>Where fixes are made, and in which order: {_link(readme, _title(files[readme], readme))}. "
        f"{_summary(files[readme])}</p>"
        + _file_list(sorted(f for f in files if f.startswith("configs/")))
        + "</div><div>"
        + f"<h3>{_link(cluster)}</h3><pre><code>{escape(files[cluster].decode())}</code></pre>"
        + "</div></div>"
    )


def _access(files: Mapping[str, bytes]) -> str:
    paths = sorted(f for f in files if f.startswith("access/"))
    if not paths:
        return '<p class="muted">No <code>access/</code> files in this bundle.</p>'
    readme = "access/README.md"
    if readme not in files:
        return _file_list(paths)
    return f"<p>{_link(readme, _title(files[readme], readme))}: {_summary(files[readme])}</p>" + _file_list(paths)


def _reference(files: Mapping[str, bytes]) -> str:
    content = files["reference.md"]
    sections = [line[3:] for line in content.decode().splitlines() if line.startswith("## ")]
    return (
        f"<p>{_link('reference.md', _title(content, 'reference.md'))}: "
        + "; ".join(_inline(s) for s in sections)
        + ".</p>"
    )


def _every_file(files: Mapping[str, bytes]) -> str:
    count = f"<p>{len(files) + 1} files with this page, all of them relative to it.</p>"
    return count + _file_list(sorted(files), files)

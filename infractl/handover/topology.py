"""The bundle's topology.md and topology.svg: nodes and their ranks, the addresses collectives
use, the rendezvous endpoint, the store, the measured bottleneck, and how to grow the cluster.

Both are drawn from the cluster record (``.infractl/<cluster>/cluster.json``), the interface each
node's collectives use (``interfaces``: from the network environment Ansible's network role wrote
there) and the newest bench baseline."""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from html import escape
from typing import Any

from infractl.statedir import ClusterRecord

__all__ = ["topology_markdown", "topology_svg"]


def _bottleneck(bench: dict[str, Any] | None) -> str:
    if bench is None:
        return "not measured yet: run `infractl bench RUN.yaml --nodes 1,2` and regenerate the bundle"
    largest = bench["results"][-1]
    return (
        f"`infractl bench` {bench['bench_id']} ({bench['scaling']} scaling of run {bench['run']!r}): at "
        f"{largest['nodes']} node(s) {largest['efficiency']:.0%} efficiency, {largest['tokens_per_s']:,.0f} tokens/s; "
        f"the dominant idle cause is {bench['dominant_idle_cause'].replace('_', ' ')}"
    )


def topology_markdown(
    cluster: ClusterRecord,
    interfaces: dict[str, str | None],
    bench: dict[str, Any] | None,
    provider_facts: Sequence[str] = (),
) -> str:
    """``provider_facts``: what the provider says of the cluster's hosts (``Provider.topology``)."""
    spec, nodes = cluster.spec, cluster.nodes
    rdzv = cluster.rendezvous
    processes = spec.processes_per_node
    lines = [
        f"# Topology of cluster `{cluster.name}`",
        "",
        f"- Provider: `{spec.provider}`; {len(nodes)} node(s) x {processes} rank(s) per node = "
        f"{len(nodes) * processes} rank(s) at most.",
        *(f"- {fact}" for fact in provider_facts),
        f"- Rendezvous (torchrun's c10d store, run by `infractl up`, never on a training node): "
        f"`{rdzv.host}:{rdzv.port}`.",
        f"- Store (checkpoints, metrics, drills, benchmarks): `{cluster.store}`.",
        f"- Measured bottleneck: {_bottleneck(bench)}.",
        "",
        "| node | address | ranks | interface for collectives (GLOO/NCCL_SOCKET_IFNAME) | work directory |",
        "|---|---|---|---|---|",
    ]
    for i, node in enumerate(nodes):
        ranks = ", ".join(str(i * processes + r) for r in range(processes))
        iface = interfaces.get(node.name) or "not configured yet"
        lines.append(f"| {node.name} | {node.address} | {ranks} | {iface} | `{node.workdir}` |")
    logins = [node for node in nodes if node.ssh]
    if logins:
        lines += ["", "Log in to a node (its host key is pinned: ssh refuses any other):", "", "```bash"]
        lines += [shlex.join(node.ssh.argv(node.address)) for node in logins if node.ssh]
        lines += ["```"]
    lines += [
        "",
        "Ranks are assigned by torchrun's rendezvous at each (re)start; the table shows them in node order, "
        "as a full world starts.",
        "",
        "## Growing the cluster",
        "",
        f"1. Raise `nodes` in cluster.yaml (now {len(nodes)}), keeping `processes_per_node` ({processes}) the "
        "same, and run `infractl up`: the new nodes pass the health gate before any run uses them.",
        "2. Raise the run's `nodes.max` in run.yaml. Every world size between `nodes.min` and `nodes.max` "
        f"(times {processes} rank(s) per node) must divide `batch_size`: grow in multiples that keep it so.",
        "3. Start the run again (`infractl train RUN.yaml`): it resumes from its last committed checkpoint on "
        "the larger world (checkpoints reshard on load).",
        "4. Measure before and after: `infractl bench RUN.yaml --nodes 1,2,...` names the count where "
        "efficiency drops below 80%; past it, more nodes cost more than they return.",
        "",
    ]
    return "\n".join(lines)


_NODE_W, _NODE_H, _GAP, _TOP = 220, 120, 40, 150


def topology_svg(cluster: ClusterRecord, interfaces: dict[str, str | None]) -> str:
    """A drawing: the rendezvous server and the store above, one box per node with its ranks."""
    nodes, processes = cluster.nodes, cluster.spec.processes_per_node
    width = max(len(nodes) * (_NODE_W + _GAP) + _GAP, 2 * (_NODE_W + _GAP) + _GAP)
    height = _TOP + _NODE_H + 40
    rdzv = cluster.rendezvous
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="13">',
        f'<rect width="{width}" height="{height}" fill="#ffffff"/>',
        _box(_GAP, 20, _NODE_W, 60, "#e8f0fe", "rendezvous", f"{rdzv.host}:{rdzv.port}"),
        _box(width - _GAP - _NODE_W, 20, _NODE_W, 60, "#fef7e0", "store", _short(cluster.store)),
    ]
    for i, node in enumerate(nodes):
        x = _GAP + i * (_NODE_W + _GAP)
        parts.append(f'<line x1="{_GAP + _NODE_W // 2}" y1="80" x2="{x + _NODE_W // 2}" y2="{_TOP}" stroke="#4285f4"/>')
        parts.append(
            f'<line x1="{width - _GAP - _NODE_W // 2}" y1="80" x2="{x + _NODE_W // 2}" y2="{_TOP}" '
            'stroke="#f9ab00" stroke-dasharray="4 3"/>'
        )
        iface = interfaces.get(node.name) or "?"
        parts.append(_box(x, _TOP, _NODE_W, _NODE_H, "#e6f4ea", node.name, f"{node.address} ({iface})"))
        for r in range(processes):
            cx = x + 30 + r * 36
            rank = i * processes + r
            parts.append(f'<circle cx="{cx}" cy="{_TOP + 85}" r="14" fill="#34a853"/>')
            parts.append(f'<text x="{cx}" y="{_TOP + 90}" text-anchor="middle" fill="#ffffff">{rank}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def _box(x: int, y: int, w: int, h: int, fill: str, title: str, detail: str) -> str:
    return (
        f'<rect x="{x}" y="{y}" width="{w}" height="{h}" rx="8" fill="{fill}" stroke="#5f6368"/>'
        f'<text x="{x + 10}" y="{y + 22}" font-weight="bold">{escape(title)}</text>'
        f'<text x="{x + 10}" y="{y + 42}">{escape(detail)}</text>'
    )


def _short(uri: str, most: int = 30) -> str:
    return uri if len(uri) <= most else "…" + uri[-(most - 1) :]

"""``infractl gc``: what infractl made on this machine that no cluster owns any more, found and
removed.

A cluster owns what carries its state directory's ``short_id`` in its name (access groups, netns
namespaces and interfaces, container run roots) for as long as the directory holds a started
cluster (``up`` wrote its intent, and no ``teardown`` finished), and what carries the directory
in its marker: processes for as long as the directory holds a started cluster too (or a command
holds its lock), so a directory deleted in part (its state files gone, ``nodes/`` still written by
running agents) hides none of them; a netns node's sshd for as long as the directory exists. Anyone can
start a process that carries a marker, so gc kills only a process that is what it expects: one
run by the user gc runs as (root, for root's gc) from this machine's Python that runs infractl,
and an sshd only when it is ``/usr/sbin/sshd`` run by root (providers/netns.py). Every ``up``
lists its state directory in this machine's ledger (``state.ledger``) before it makes anything,
so a cluster under any state root is known. An ``up`` that never finished (intent, no record,
nobody holding its lock) is torn down as ``teardown`` would; everything else is deleted directly.

A cloud account is not this machine: given a cluster.yaml, gc also asks its provider what the
account holds of clusters whose state is gone from everywhere (``Provider.account_orphans``).
"""

from __future__ import annotations

import functools
import os
import sys
from dataclasses import dataclass, field

import psutil

from infractl import access, cluster, proc, providers
from infractl.config import ClusterSpec
from infractl.errors import InfractlError
from infractl.output import Output
from infractl.statedir import ClusterState, Orphan, abandoned, ledger, started_clusters

__all__ = ["Found", "collect", "find"]

# What /proc says a process of this Python runs (a venv's python is a link to it).
_PYTHON = os.path.realpath(sys.executable)


@dataclass(frozen=True)
class Found:
    interrupted: list[ClusterState]
    """Clusters whose ``up`` never finished and that nobody is working on."""
    orphans: list[Orphan]
    """What belongs to no started cluster, in the order it is removed in."""
    failed: list[str] = field(default_factory=list)
    """What could not be removed, and why (after ``collect``)."""

    def to_dict(self) -> dict[str, object]:
        return {
            "interrupted": [{"name": s.name, "dir": str(s.dir)} for s in self.interrupted],
            "orphans": [o.to_dict() for o in self.orphans],
            "failed": self.failed,
        }


def find(account: ClusterSpec | None = None) -> Found:
    """Look; change nothing. With ``account`` (a cluster.yaml), also in its provider's account
    (``Provider.account_orphans``: on aws, the clusters of its region whose state is gone)."""
    started = started_clusters()
    interrupted = [s for s in started if not s.is_up() and not s.busy()]
    # Processes first: a namespace or group goes more easily once nothing uses it. A process
    # outlives its cluster only when the state directory went, whole or in part, without a teardown.
    orphans = [
        Orphan("process", f"{process.pid} of {cluster_dir}", functools.partial(proc.kill, [process]))
        for cluster_dir, process in proc.marked()
        if _started_by_infractl(process) and abandoned(cluster_dir)
    ]
    owned = {s.short_id for s in started}
    for provider in providers.every():
        orphans += provider.orphans(owned)
    orphans += access.stray_groups(owned)
    if account is not None:
        orphans += providers.get(account.provider).account_orphans(account)
    return Found(interrupted, orphans)


def _started_by_infractl(process: psutil.Process) -> bool:
    """Whether ``process`` (it carries a cluster's marker) can be one infractl started on this
    machine: run by the user gc runs as, really and effectively, from the Python infractl runs
    with (its agents, servers and Ansible run there). A process of another user, or of another
    program, that shows a marker is never taken for one."""
    try:
        uids = process.uids()
        return uids.real == uids.effective == os.geteuid() and process.exe() == _PYTHON
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False


def collect(found: Found, out: Output) -> Found:
    """Tear down the interrupted clusters and remove the orphans ``find`` found; then forget the
    ledger's entries of directories that hold no cluster any more. What failed is named in the
    result, never raised: one stubborn leftover does not keep the rest."""
    failed = []
    for state in found.interrupted:
        out.info(f"gc: tearing down cluster {state.name!r} at {state.dir} (its `up` never finished)")
        try:
            with state.lock("gc"):
                cluster.teardown(state, out, purge=False)
        except InfractlError as exc:
            failed.append(f"cluster {state.name!r} at {state.dir}: {exc.message}")
        except (OSError, ValueError, KeyError) as exc:  # an intent no infractl wrote whole
            failed.append(f"cluster {state.name!r} at {state.dir}: its intent.json cannot be read ({exc!r})")
    for orphan in found.orphans:
        try:
            orphan.remove()
        except InfractlError as exc:
            failed.append(f"{orphan.kind} {orphan.name}: {exc.message}")
    started = {s.short_id for s in started_clusters()}
    for entry in sorted(ledger().glob("*.json")) if ledger().is_dir() else []:
        if entry.stem not in started:
            entry.unlink(missing_ok=True)
    return Found(found.interrupted, found.orphans, failed)

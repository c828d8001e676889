"""A node as the control plane records it (``Node``: its name, address, work directory and ranks)
and how it logs in to one that is another machine (``SshLogin``). A provider's module describes
its nodes so (its ``inventory`` output), and the cluster record keeps them so."""

from __future__ import annotations

import shlex
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = ["Node", "SshLogin"]


@dataclass(frozen=True)
class SshLogin:
    """How to log in to a node's sshd: as ``user`` with the private key ``identity_file``,
    accepting only the host key pinned in ``known_hosts``."""

    user: str
    identity_file: Path
    known_hosts: Path
    jump: str | None = None
    """``user@host`` (or ``ssh://user@host:port``) of the jump host the node is reached through (the
    same key and pinned host keys), or None: reached directly."""
    port: int = 22
    """The node's sshd port."""

    def options(self) -> list[str]:
        """``ssh`` options: the host key must match the pinned one (never accepted on first use), only
        the cluster's key is offered, nothing prompts, and neither the operator's agent nor their X
        display is forwarded (whatever the user's ssh_config says: root on a node, or anyone who
        becomes it, could use either as the operator); through the jump host where there is one
        (a ProxyCommand with these same options: ``-J`` would not pass them on)."""
        direct = [
            "-o", f"UserKnownHostsFile={self.known_hosts}",
            "-o", "StrictHostKeyChecking=yes",
            "-o", "GlobalKnownHostsFile=/dev/null",
            "-o", f"IdentityFile={self.identity_file}",
            "-o", "IdentitiesOnly=yes",
            "-o", "BatchMode=yes",
            "-o", "ConnectTimeout=10",
            "-o", "ForwardAgent=no",
            "-o", "ForwardX11=no",
        ]  # fmt: skip
        port = ["-o", f"Port={self.port}"] if self.port != 22 else []
        if self.jump is None:
            return [*direct, *port]
        proxy = shlex.join(["ssh", *direct, "-W", "%h:%p", self.jump])
        return [*direct, *port, "-o", f"ProxyCommand={proxy}"]

    def argv(self, address: str, command: str | None = None) -> list[str]:
        """The ``ssh`` command line that runs the shell command ``command`` on the node at ``address``
        (without one: that logs in)."""
        return ["ssh", *self.options(), "-l", self.user, address, *([command] if command is not None else [])]


@dataclass(frozen=True)
class Node:
    """One provisioned node, as the module's ``inventory`` output describes it (and the cluster's
    state file records it: :meth:`record`, :meth:`from_record`). What a provider knows of a node
    besides (a namespace, an instance type) is the provider's own: other fields of a record are
    not read."""

    name: str
    """``node-<index>``; the index is the node's rank in the health check."""
    address: str
    """Address the node is reached at (``127.0.0.1`` on the local provider)."""
    workdir: Path
    """Absolute path of the node's work directory."""
    processes: int
    """Training processes (ranks) the node runs."""
    ssh: SshLogin | None = None
    """None: the node is this machine, reached without a login (local provider)."""

    @classmethod
    def from_record(cls, item: dict[str, Any]) -> Node:
        ssh = item.get("ssh")
        return cls(
            name=item["name"],
            address=item["address"],
            workdir=Path(item["workdir"]),
            processes=int(item["processes"]),
            ssh=SshLogin(
                ssh["user"],
                Path(ssh["identity_file"]),
                Path(ssh["known_hosts"]),
                ssh.get("jump"),
                int(ssh.get("port", 22)),
            )
            if ssh
            else None,
        )

    def record(self) -> dict[str, Any]:
        """The node as JSON, without the fields its provider does not use."""
        item: dict[str, Any] = {
            "name": self.name,
            "address": self.address,
            "workdir": str(self.workdir),
            "processes": self.processes,
        }
        if self.ssh is not None:
            item["ssh"] = {k: v if isinstance(v, int) else str(v) for k, v in asdict(self.ssh).items() if v is not None}
        return item

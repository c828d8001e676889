"""A team's existing machines, on this machine, for the ssh provider's tests: each host is a network
namespace on a bridge (``ixl<id>``, this machine at .1) with its own mount namespace, made the way
a team's server is and not the way infractl makes nodes: its own ``/etc`` (this machine's, copied,
with a login user ``ops`` who has password-less sudo and a user ``guest`` who has none), its own
``/root``, ``/home``, ``/srv`` (the team's files), ``/var/lib/containers`` (the team's image store),
an empty ``/run`` and ``/var/lib/infractl``; an sshd with a host key of its own that lets ``ops``
and ``guest`` in with the lab's key; and a process of the team's (``team-daemon``) that must
outlive any cluster. infractl is told only addresses, a user, a key and a known_hosts file.

``snapshot`` reads what must be the same before ``up`` and after ``teardown``: the processes of the
host's namespace, and every file of its own folders (infractl's ``/var/lib/infractl`` aside).
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from awsemu import engine_settings, ip, remove_namespace, start_sshd

__all__ = ["LAB_RECORD", "Lab", "LabHost", "lab", "remove_lab"]

_SSHD = "/usr/sbin/sshd"
# The host's own folders: the path it sees, and the folder of the host's that holds it.
_PRIVATE = {
    "/etc": "etc",
    "/root": "root",
    "/home": "home",
    "/srv": "srv",
    "/var/lib/containers": "containers",
    "/var/lib/infractl": "infractl",
}
# What the comparison leaves out: infractl's own folder; and the copies of the previous version that
# shadow-utils writes beside the account files at every groupadd and groupdel (the account files
# themselves are compared).
_NOT_COMPARED = {"infractl"}
_BACKUPS = {"etc/group-", "etc/gshadow-", "etc/passwd-", "etc/shadow-"}
_USERS = {"ops": 2101, "guest": 2102}
#: In a lab's folder while its network exists: its bridge and namespaces, so that what a killed test
#: session left can be removed later (``remove_lab``; tests/conftest.py).
LAB_RECORD = "lab.json"


@dataclass
class LabHost:
    name: str
    address: str
    namespace: str
    folder: Path
    sshd_pid: int
    team_pid: int

    def public_key_line(self) -> str:
        """The host's key as a known_hosts line for its address."""
        key = (self.folder / "etc" / "ssh" / "ssh_host_ed25519_key.pub").read_text().split()
        return f"{self.address} {key[0]} {key[1]}"


class Lab:
    """The hosts of a lab on the bridge ``ixl<id>`` (see the module's docstring)."""

    def __init__(self, folder: Path, subnet: str) -> None:
        self.folder = folder
        self.network = ipaddress.IPv4Network(subnet)
        self.id = hashlib.sha256(str(folder).encode()).hexdigest()[:6]
        self.bridge = f"ixl{self.id}"
        self.gateway = str(self.network.network_address + 1)
        self.key = folder / "lab_ed25519"
        self.hosts: dict[str, LabHost] = {}

    def _record(self) -> None:
        namespaces = [f"{self.bridge}-{index}" for index in range(len(self.hosts) + 1)]
        (self.folder / LAB_RECORD).write_text(json.dumps({"bridge": self.bridge, "namespaces": namespaces}))

    def open(self) -> None:
        self._record()
        ip("link", "add", self.bridge, "type", "bridge")
        ip("addr", "add", f"{self.gateway}/{self.network.prefixlen}", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.key)], check=True)

    def add(self, name: str) -> LabHost:
        index = len(self.hosts)
        address = str(self.network.network_address + 10 + index)
        namespace, veth = f"{self.bridge}-{index}", f"{self.bridge}h{index}"
        folder = self.folder / "hosts" / name
        folder.mkdir(parents=True)
        self._record()
        ip("netns", "add", namespace)
        ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", namespace)
        ip("link", "set", veth, "master", self.bridge, "up")
        ip("-n", namespace, "addr", "add", f"{address}/{self.network.prefixlen}", "dev", "eth0")
        ip("-n", namespace, "link", "set", "eth0", "up")
        ip("-n", namespace, "link", "set", "lo", "up")
        ip("-n", namespace, "route", "add", "default", "via", self.gateway)
        self._prepare(folder)
        sshd = start_sshd(namespace, folder, {point: folder / inside for point, inside in _PRIVATE.items()})
        team = subprocess.Popen(
            [
                "nsenter",
                f"--net=/run/netns/{namespace}",
                f"--mount=/proc/{sshd}/ns/mnt",
                "bash",
                "-c",
                "exec -a team-daemon sleep 86400",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + 10  # nsenter joins the namespace a moment after it starts
        while str(team.pid) not in _pids(namespace):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the team's process did not start in {namespace}")
            time.sleep(0.05)
        host = LabHost(name, address, namespace, folder, sshd, team.pid)
        self.hosts[name] = host
        return host

    def _prepare(self, folder: Path) -> None:
        """The host's own folders: /etc copied (its users and groups, sudo, the engine's settings for
        this machine's kernel), the team's files, the login users' homes and keys."""
        for inside in _PRIVATE.values():
            (folder / inside).mkdir(exist_ok=True)
        etc = folder / "etc"
        shutil.rmtree(etc)
        shutil.copytree("/etc", etc, symlinks=True)
        for user, uid in _USERS.items():
            with (etc / "passwd").open("a") as f:
                f.write(f"{user}:x:{uid}:{uid}::/home/{user}:/bin/bash\n")
            with (etc / "group").open("a") as f:
                f.write(f"{user}:x:{uid}:\n")
            with (etc / "shadow").open("a") as f:
                f.write(f"{user}:*:20000:0:99999:7:::\n")
            ssh = folder / "home" / user / ".ssh"
            ssh.mkdir(parents=True)
            shutil.copy(self.key.with_suffix(".pub"), ssh / "authorized_keys")
            for path in (ssh.parent, ssh, ssh / "authorized_keys"):
                os.chown(path, uid, uid)
        (etc / "sudoers.d" / "ops").write_text("ops ALL=(ALL) NOPASSWD: ALL\n")
        (etc / "sudoers.d" / "ops").chmod(0o440)
        engine_settings(etc)
        (folder / "srv" / "datasets").mkdir()
        (folder / "srv" / "datasets" / "README").write_text("the team's data: infractl must not touch it\n")
        for key in (etc / "ssh").glob("ssh_host_*"):
            key.unlink()
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(etc / "ssh" / "ssh_host_ed25519_key")], check=True
        )
        (etc / "ssh" / "sshd_config").write_text(
            "ListenAddress 0.0.0.0\nHostKey /etc/ssh/ssh_host_ed25519_key\n"
            f"PidFile {folder / 'sshd.pid'}\nAllowUsers ops guest\nPermitRootLogin no\n"
            "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
            "AllowTcpForwarding yes\nX11Forwarding no\nSubsystem sftp internal-sftp\n"
        )

    def known_hosts(self, path: Path, *names: str) -> Path:
        path.write_text("".join(f"{self.hosts[n].public_key_line()}\n" for n in names or self.hosts))
        return path

    def snapshot(self, name: str) -> dict[str, object]:
        """What of host ``name`` must survive a cluster unchanged: its processes (pid and command
        line) and every file of its own folders but infractl's (path, mode, owner, content hash)."""
        host = self.hosts[name]
        listed = subprocess.run(["ip", "netns", "pids", host.namespace], capture_output=True, text=True, check=True)
        processes = {}
        for pid in listed.stdout.split():
            try:
                processes[int(pid)] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
            except OSError:
                continue
        files = {}
        for inside in _PRIVATE.values():
            if inside in _NOT_COMPARED:
                continue
            root = host.folder / inside
            for path in sorted([root, *root.rglob("*")]):
                info = path.lstat()
                digest = ""
                if path.is_file() and not path.is_symlink():
                    digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
                relative = str(path.relative_to(host.folder))
                if relative not in _BACKUPS:
                    files[relative] = (info.st_mode, info.st_uid, info.st_gid, digest)
        return {"processes": processes, "files": files}

    def close(self) -> None:
        for host in self.hosts.values():
            remove_namespace(host.namespace, {host.sshd_pid, host.team_pid})
        self.hosts.clear()
        remove_lab(self.folder)


def remove_lab(folder: Path) -> None:
    """What a lab in ``folder`` left (its ``LAB_RECORD``): its hosts' namespaces, every process in
    them killed by PID, and its bridge."""
    record = folder / LAB_RECORD
    if not record.is_file():
        return
    made = json.loads(record.read_text())
    for namespace in made["namespaces"]:
        remove_namespace(namespace, set())
    subprocess.run(["ip", "link", "del", made["bridge"]], capture_output=True, check=False)
    record.unlink()


def _pids(namespace: str) -> list[str]:
    listed = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True, check=False)
    return listed.stdout.split()


@contextmanager
def lab(folder: Path, subnet: str, names: list[str]) -> Iterator[Lab]:
    """A lab of hosts ``names`` on ``subnet`` (a /24), its files in ``folder``; gone when the block ends."""
    folder.mkdir(parents=True, exist_ok=True)
    made = Lab(folder, subnet)
    made.open()
    try:
        for name in names:
            made.add(name)
        yield made
    finally:
        made.close()

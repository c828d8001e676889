"""What the ssh provider asks of and does to the team's hosts directly, over SSH as the login user:
the preflight (``check_hosts``: every host, before anything changes), the first trust of their
keys (``scan_keys``), and removing what infractl put on a host (``clean_host``, ``left_on_host``)
for ``teardown`` and, from the machine's own record of the hosts (``HostRecord``), for ``gc``.

What infractl puts on a host, and nothing else: the cluster's work directory (its image store
among it), the container run root under ``/run/infractl``, the access roles' groups (named after
the cluster's ``short_id``), the firewall role's chain, and processes with the cluster's marker;
and what the tools it runs there leave outside those paths (``FOOTPRINTS``: podman's blob cache and
configuration folder, Ansible's temporary folder), removed only where the host had none before the
cluster's first ``up``.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from infractl import proc
from infractl.errors import InfractlError
from infractl.node import Node, SshLogin
from infractl.statedir import ledger, write_private

__all__ = [
    "CONTAINERS",
    "RUNROOTS",
    "FOOTPRINTS",
    "HostRecord",
    "Reached",
    "absent_footprints",
    "check_hosts",
    "clean_host",
    "left_on_host",
    "scan_keys",
]

#: The folder of a node's work directory that holds its image store (``storage/``, ``certs/``).
CONTAINERS = "containers"
#: Where each host keeps the run state of the cluster's engine (podman refuses a long run root).
RUNROOTS = Path("/run/infractl")
#: The firewall role's chain (playbooks/roles/firewall) and the partition drill's (providers/remote.py).
_CHAINS = ("INFRACTL-GUARD", "INFRACTL-CUT-IN", "INFRACTL-CUT-OUT")
# A host's clock may be this far from this machine's (beyond the round trip's uncertainty): TLS
# certificates of the cluster's registry, checkpoint times and the drills' timings read both.
_CLOCK_OFFSET_S = 5.0
# The oldest Python Ansible's modules run with (ansible-core 2.17 and later need 3.8).
_PYTHON_MIN = (3, 8)
# Seconds a preflight question to a host may take.
_CHECK_TIMEOUT_S = 30.0
#: What podman and Ansible leave on a host outside infractl's paths, whatever their options: podman
#: 4's pull writes its blob cache to the system folder (``--root`` does not move it) and its client
#: makes root's configuration folder; Ansible keeps a temporary folder in the login's home (``~``).
#: Each as (path, how it goes): ``tree`` removed whole, ``empty`` removed when empty. Deepest first.
FOOTPRINTS = (
    ("/var/lib/containers/cache", "tree"),
    ("/var/lib/containers", "empty"),
    ("/root/.config/containers", "tree"),
    ("/root/.config", "empty"),
    ("~/.ansible", "tree"),
)
# What ssh says, on stderr, when the host's key is not the pinned one, or none is pinned.
_KEY_CHANGED = ("REMOTE HOST IDENTIFICATION HAS CHANGED", "Host key verification failed")
_NO_KEY = "No ED25519 host key is known"


@dataclass(frozen=True)
class Reached:
    """A host as the preflight and the cleaning reach it: its role in words, name, address, login."""

    name: str
    address: str
    login: SshLogin

    def run(
        self, script: str, *, timeout: float = _CHECK_TIMEOUT_S, sudo: bool = False
    ) -> subprocess.CompletedProcess[str]:
        """``script`` in a shell on the host (as root through password-less sudo with ``sudo``)."""
        command = script
        if sudo and self.login.user != "root":
            command = f"sudo -n sh -c {shlex.quote(script)}"
        try:
            return proc.run(self.login.argv(self.address, command), timeout=timeout)
        except subprocess.TimeoutExpired:
            return subprocess.CompletedProcess([], 255, "", f"no answer within {timeout:g}s")


def _facts_script(workdir: str) -> str:
    """Read-only: what the preflight needs to know of a host, one ``key=value`` a line."""
    return "; ".join(
        [
            'echo "uid=$(id -u)"',
            'echo "user=$(id -un)"',
            'if [ "$(id -u)" = 0 ] || sudo -n true >/dev/null 2>&1; then echo sudo=yes; else echo sudo=no; fi',
            'echo "os=$(uname -s)"',
            'echo "python=$(/usr/bin/python3 -c \'import sys; print("%d.%d" % sys.version_info[:2])\' 2>/dev/null)"',
            'echo "podman=$(PATH=$PATH:/usr/sbin:/sbin command -v podman)"',
            'echo "iptables=$(PATH=$PATH:/usr/sbin:/sbin command -v iptables)"',
            'echo "docker-registry=$(command -v docker-registry)"',
            f'd={shlex.quote(workdir)}; while [ ! -d "$d" ]; do d=$(dirname "$d"); done; '
            'echo "free_kb=$(df -Pk "$d" | awk \'NR==2 {print $4}\')"',
            'echo "gpus=$(nvidia-smi -L 2>/dev/null | grep -c "^GPU")"',
            'echo "uid_10001=$(getent passwd 10001 | cut -d: -f1)"',
            'echo "time=$(date +%s.%N)"',
        ]
    )


def _ssh_problem(stderr: str, login: SshLogin) -> str:
    """Why ssh could not log in, in words."""
    if any(said in stderr for said in _KEY_CHANGED) and "No " not in stderr:
        return (
            f"its host key is not the one pinned in {login.known_hosts}: refused (if the host was reinstalled, "
            "check its new key and run `infractl keyscan`)"
        )
    if "host key is known" in stderr or _NO_KEY in stderr:
        return f"no host key of it is pinned in {login.known_hosts} (run `infractl keyscan`)"
    if "Permission denied" in stderr:
        return f"it refuses the login of {login.user} with key {login.identity_file}"
    return f"unreachable over SSH ({proc.last_line(stderr) or 'no answer'})"


def _check_one(host: Reached, workdir: str, *, gpus: int, free_bytes: int, needs: Sequence[str]) -> list[str]:
    before = time.time()
    done = host.run(_facts_script(workdir))
    after = time.time()
    where = f"{host.name} ({host.address})"
    if done.returncode == 255:
        return [f"{where}: {_ssh_problem(done.stderr, host.login)}"]
    facts = dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)
    problems = []
    if facts.get("sudo") != "yes":
        problems.append(f"{where}: user {facts.get('user', host.login.user)} is not root and has no password-less sudo")
    if facts.get("os") != "Linux":
        problems.append(f"{where}: runs {facts.get('os') or 'an unknown system'}, not Linux")
    python = tuple(int(part) for part in facts.get("python", "").split(".") if part.isdigit())
    if python < _PYTHON_MIN:
        problems.append(
            f"{where}: /usr/bin/python3 is missing or older than {'.'.join(map(str, _PYTHON_MIN))} (Ansible runs it)"
        )
    for tool in needs:
        if not facts.get(tool):
            problems.append(f"{where}: {tool} is not installed (infractl installs no package on a team's machine)")
    if int(facts.get("free_kb") or 0) * 1024 < free_bytes:
        problems.append(
            f"{where}: {int(facts.get('free_kb') or 0) // 1024} MiB free under {workdir}, the image needs "
            f"{free_bytes >> 20} MiB"
        )
    if int(facts.get("gpus") or 0) < gpus:
        problems.append(f"{where}: has {int(facts.get('gpus') or 0)} GPU(s), its host entry declares {gpus}")
    if facts.get("uid_10001"):
        problems.append(
            f"{where}: account {facts['uid_10001']} has user id 10001, the trainer image's user: give it another id"
        )
    try:
        offset = float(facts["time"]) - (before + after) / 2
    except (KeyError, ValueError):
        offset = 0.0
    if abs(offset) > _CLOCK_OFFSET_S + (after - before) / 2:
        problems.append(f"{where}: its clock is {offset:+.1f}s off this machine's (sync it with NTP)")
    return problems


def check_hosts(
    hosts: Sequence[tuple[Reached, int]], controller: Reached | None, workdir: str, *, free_bytes: int
) -> list[str]:
    """Every problem of every host (``hosts``: each with the GPUs it must have) and of the
    controller, one line each, naming the host; nothing changes on any of them."""

    def check(entry: tuple[Reached, int, Sequence[str]]) -> list[str]:
        host, gpus, needs = entry
        return _check_one(host, workdir, gpus=gpus, free_bytes=free_bytes, needs=needs)

    entries: list[tuple[Reached, int, Sequence[str]]] = [(h, gpus, ("podman", "iptables")) for h, gpus in hosts]
    if controller is not None:
        entries.append((controller, 0, ("podman", "docker-registry")))
    with ThreadPoolExecutor(max_workers=min(16, len(entries))) as pool:
        return [problem for found in pool.map(check, entries) for problem in found]


def scan_keys(hosts: Iterable[tuple[str, str, int]], jump: Reached | None) -> list[tuple[str, str]]:
    """The host keys each host (name, address, port) offers now, as known_hosts lines with the
    name they belong to; scanned from ``jump`` (logged in with the key it offered the scan of it,
    which the operator confirms with the rest) for hosts behind it. ``InfractlError`` naming a
    host that offers none."""
    found: list[tuple[str, str]] = []
    for name, address, port in hosts:
        scan = ["ssh-keyscan", "-T", "10", "-t", "ed25519,ecdsa,rsa", "-p", str(port), address]
        done = jump.run(shlex.join(scan), timeout=60) if jump is not None else proc.run(scan, timeout=60)
        lines = [line for line in done.stdout.splitlines() if line and not line.startswith("#")]
        if not lines:
            raise InfractlError(f"{name} ({address}:{port}) offered no host key: {proc.last_line(done.stderr)}")
        found += [(name, line) for line in lines]
    return found


def _marked(short_dir: str) -> str:
    """A shell loop that prints the pid of every process carrying the cluster's marker."""
    marker = shlex.quote(f"{proc.CLUSTER_ENV}={short_dir}")
    return (
        "for p in /proc/[0-9]*; do "
        f"if tr '\\0' '\\n' <\"$p/environ\" 2>/dev/null | grep -qxF -- {marker}; then echo \"${{p#/proc/}}\"; fi; done"
    )


def _groups(short_id: str) -> str:
    """A shell pipeline that prints the access roles' groups of the cluster (access/roles.py names
    them ``<name>-<short_id>-<role>``, a role's name letters and '-')."""
    return f"getent group | cut -d: -f1 | grep -E -- {shlex.quote(f'-{short_id}-[a-z][a-z-]*$')}"


def _path(path: str, login: SshLogin) -> str:
    """A footprint's path for the shell: ``~`` is the login user's home (the script runs as root)."""
    if path.startswith("~/"):
        return f'"$(getent passwd {shlex.quote(login.user)} | cut -d: -f6)"/{shlex.quote(path[2:])}'
    return shlex.quote(path)


def absent_footprints(host: Reached) -> list[str]:
    """The ``FOOTPRINTS`` the host does not have now (before the cluster's first ``up`` changes it):
    those ``clean_host`` removes. ``InfractlError`` when the host does not answer."""
    script = "; ".join(f"[ -e {_path(path, host.login)} ] || echo {shlex.quote(path)}" for path, _ in FOOTPRINTS)
    done = host.run(script + "; exit 0", sudo=True)
    if done.returncode != 0:
        raise InfractlError(f"{host.name} ({host.address}): {_ssh_problem(done.stderr, host.login)}")
    return done.stdout.split()


def clean_host(
    host: Reached,
    *,
    workdir: Path,
    base: Path,
    cluster_dir: str,
    short_id: str,
    engine: Sequence[str],
    absent: Sequence[str],
) -> None:
    """Remove everything infractl put on ``host`` for the cluster: its containers and image store
    (by its engine, ``engine``), its processes, its work directory (and ``base`` once empty), its run
    roots, its groups and the firewall's chains, and the ``FOOTPRINTS`` that were ``absent`` before
    the cluster's first ``up``. Idempotent; ``InfractlError`` naming the host when
    it cannot (it does not answer, or a step fails)."""
    quoted = shlex.quote(str(workdir))
    runroots = shlex.quote(str(RUNROOTS)) + f"/{short_id}-*"
    chains = " ".join(_CHAINS)
    script = " ; ".join(
        [
            "set -u",
            f"if [ -d {quoted}/{CONTAINERS}/storage ]; then "
            f"{shlex.join(engine)} system reset --force >/dev/null 2>&1; fi",
            f'for pid in $({_marked(cluster_dir)}); do kill -9 "$pid" 2>/dev/null; done',
            # The servers a controller host runs as its own processes (providers/remote.py's pid files).
            f'for f in {quoted}/run/*.pid; do [ -f "$f" ] && kill -9 "$(cat "$f")" 2>/dev/null; done',
            f"rm -rf -- {quoted} {runroots}",
            f"rmdir -- {shlex.quote(str(base))} {shlex.quote(str(RUNROOTS))} 2>/dev/null",
            f'for g in $({_groups(short_id)}); do groupdel "$g" || exit 1; done',
            *(
                f"rm -rf -- {_path(path, host.login)}"
                if how == "tree"
                else f"rmdir -- {_path(path, host.login)} 2>/dev/null"
                for path, how in FOOTPRINTS
                if path in absent
            ),
            f"for c in {chains}; do for hook in INPUT OUTPUT; do "
            'while iptables -w -D "$hook" -j "$c" 2>/dev/null; do :; done; done; '
            'if iptables -w -S "$c" >/dev/null 2>&1; then '
            'iptables -w -F "$c" && iptables -w -X "$c" || exit 1; fi; done',
            "exit 0",
        ]
    )
    done = host.run(script, timeout=300, sudo=True)
    if done.returncode != 0:
        why = _ssh_problem(done.stderr, host.login) if done.returncode == 255 else proc.last_line(done.stderr)
        raise InfractlError(f"{host.name} ({host.address}): could not remove what infractl put there: {why}")


def left_on_host(host: Reached, *, workdir: Path, cluster_dir: str, short_id: str, absent: Sequence[str]) -> list[str]:
    """What of the cluster is still on ``host``, one item each (what ``clean_host`` removes)."""
    quoted = shlex.quote(str(workdir))
    script = " ; ".join(
        [
            f'[ -e {quoted} ] && echo "work directory {workdir}"',
            f'for r in {shlex.quote(str(RUNROOTS))}/{short_id}-*; do [ -e "$r" ] && echo "container run root $r"; done',
            f'for pid in $({_marked(cluster_dir)}); do echo "process $pid"; done',
            f'for g in $({_groups(short_id)}); do echo "group $g"; done',
            f'for c in {" ".join(_CHAINS)}; do iptables -w -S "$c" >/dev/null 2>&1 && echo "iptables chain $c"; done',
            *(
                f"[ -e {_path(path, host.login)} ] && echo {shlex.quote(f'{path} (made by podman or Ansible)')}"
                for path, how in FOOTPRINTS
                if path in absent and how == "tree"
            ),
            "exit 0",
        ]
    )
    done = host.run(script, sudo=True)
    if done.returncode != 0:
        return [f"{host.name}: unknown ({_ssh_problem(done.stderr, host.login)})"]
    return [f"{host.name}: {line}" for line in done.stdout.splitlines() if line.strip()]


@dataclass(frozen=True)
class HostRecord:
    """This machine's record of the hosts an ``up`` configured for a cluster, outside its state
    directory (``gc`` cleans the hosts of a cluster whose state directory is gone): written before
    anything changes on a host, removed once every host is clean."""

    short_id: str
    name: str
    cluster_dir: str
    workdir: str
    base: str
    hosts: tuple[Node, ...]
    """The training hosts and the controller host, with their logins."""
    absent: dict[str, list[str]]
    """Host name -> the ``FOOTPRINTS`` it did not have before the cluster's first ``up``."""

    @staticmethod
    def folder() -> Path:
        return ledger().parent / "ssh-hosts"

    def save(self) -> None:
        document = {
            "name": self.name,
            "cluster_dir": self.cluster_dir,
            "workdir": self.workdir,
            "base": self.base,
            "hosts": [node.record() for node in self.hosts],
            "absent": self.absent,
        }
        write_private(self.folder() / f"{self.short_id}.json", json.dumps(document, indent=2) + "\n")

    def remove(self) -> None:
        (self.folder() / f"{self.short_id}.json").unlink(missing_ok=True)

    @classmethod
    def load(cls, short_id: str) -> HostRecord | None:
        """The record of the cluster ``short_id``; None when there is none (or it cannot be read:
        not one of ours, or half written)."""
        path = cls.folder() / f"{short_id}.json"
        try:
            document = json.loads(path.read_text())
            return cls(
                short_id=short_id,
                name=document["name"],
                cluster_dir=document["cluster_dir"],
                workdir=document["workdir"],
                base=document["base"],
                hosts=tuple(Node.from_record(item) for item in document["hosts"]),
                absent={str(k): [str(p) for p in v] for k, v in document["absent"].items()},
            )
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None

    @classmethod
    def every(cls) -> list[HostRecord]:
        paths = sorted(cls.folder().glob("*.json")) if cls.folder().is_dir() else []
        return [found for path in paths if (found := cls.load(path.stem)) is not None]

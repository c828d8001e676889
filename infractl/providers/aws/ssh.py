"""How the control plane logs in to a cluster's instances: the cluster's SSH keys
(``ClusterKeys``), each instance's own host key replacing the bootstrap one (``HostKeys``), and
the wait until every instance answers (``wait_for_ssh``)."""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from infractl import proc
from infractl.config import ClusterSpec
from infractl.errors import ConfigError, InfraError
from infractl.node import SshLogin
from infractl.providers.aws.spec import AwsSpec
from infractl.providers.remote import SshNodes
from infractl.statedir import ClusterState, write_private

__all__ = ["ClusterKeys", "HostKeys", "ssh_hosts", "wait_for_ssh"]


@dataclass(frozen=True)
class ClusterKeys:
    """The cluster's SSH keys, OpenSSH private key files with their ``.pub`` beside: ``login`` logs
    in to every instance, ``host`` is every new instance's bootstrap host key (user_data installs
    it), so the operator's known_hosts pins it before any instance exists (``HostKeys`` then
    replaces it on each instance with a key of the instance's own)."""

    login: Path
    host: Path

    @classmethod
    def of(cls, spec: ClusterSpec, state: ClusterState) -> ClusterKeys:
        """The cluster's keys, made in its state directory (0600) the first time they are asked
        for; the login key is ``aws.ssh_key`` where cluster.yaml names one."""
        aws = spec.settings(AwsSpec)
        assert aws is not None
        folder = state.dir / "ssh"
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        host = folder / "host_ed25519"
        login = Path(aws.ssh_key).expanduser() if aws.ssh_key else folder / "id_ed25519"
        for key, comment in ((host, f"infractl-{spec.name}-host"), (login, f"infractl-{spec.name}")):
            if not key.is_file() and key.parent == folder:
                made = proc.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(key)])
                if made.returncode != 0:
                    raise InfraError(f"ssh-keygen could not make {key}: {made.stderr.strip()}")
            missing = [path for path in (key, _public(key)) if not path.is_file()]
            if missing:
                raise ConfigError(
                    f"{missing[0]} does not exist: give the private key, its .pub beside it", field="aws.ssh_key"
                )
        return cls(login=login, host=host)

    def variables(self) -> dict[str, object]:
        """infra/aws's ``ssh_public_key`` and ``host_key``."""
        return {
            "ssh_public_key": _public(self.login).read_text().strip(),
            "host_key": {"private": self.host.read_text(), "public": self.host_public()},
        }

    def host_public(self) -> str:
        return _public(self.host).read_text().strip()


def _public(key: Path) -> Path:
    """The public half of an OpenSSH private key file: ``<name>.pub`` beside it."""
    return key.with_name(f"{key.name}.pub")


#: Run as root on an instance: ``prepare`` makes a new ed25519 host key beside the one sshd reads
#: (``sshd -T`` says which; a key an earlier ``prepare`` made is kept) and prints its public half;
#: ``install`` puts it in the old one's place and has sshd load it (systemd's reload, else SIGHUP
#: to the pid sshd says it writes). Either may run again after an interruption.
_OWN_HOST_KEY = r"""set -eu
key=$(sshd -T | awk '$1 == "hostkey" && $2 ~ /ed25519/ { print $2; exit }')
test -n "$key"
new="$key.infractl-new"
case "$1" in
prepare)
  if ! test -s "$new" || ! test -s "$new.pub"; then
    rm -f "$new" "$new.pub"
    ssh-keygen -q -t ed25519 -N '' -C "$(hostname)" -f "$new" </dev/null
  fi
  cat "$new.pub" ;;
install)
  if test -s "$new"; then mv -f "$new.pub" "$key.pub" && mv -f "$new" "$key"; fi
  if test -d /run/systemd/system; then systemctl reload ssh.service
  else kill -HUP "$(cat "$(sshd -T | awk '$1 == "pidfile" { print $2 }')")"; fi ;;
esac
"""
_HOST_KEY = re.compile(r"^ssh-ed25519 [A-Za-z0-9+/]+=*$")


class HostKeys:
    """The host keys the control plane accepts from each instance, by instance id, kept in
    ``<state>/ssh/host_keys.json`` and written out as the cluster's known_hosts: user data's
    bootstrap key, the same on every instance and readable by whoever reads user data, until
    ``own`` has the instance make a key of its own; both while that key is being installed; then
    that key alone, so no instance can pass for another."""

    def __init__(self, state: ClusterState, bootstrap: str, addresses: Mapping[str, Sequence[str]]) -> None:
        self.path = state.dir / "ssh" / "host_keys.json"
        self.known_hosts = state.dir / "ssh" / "known_hosts"
        self.bootstrap = bootstrap
        self.addresses = {instance: list(known_as) for instance, known_as in addresses.items()}
        saved: dict[str, list[str]] = json.loads(self.path.read_text()) if self.path.is_file() else {}
        # An instance that is gone is forgotten; a new one has the bootstrap key.
        self.keys = {instance: saved.get(instance, [bootstrap]) for instance in self.addresses}
        self._write()

    def pin(self, instance: str, keys: Sequence[str]) -> None:
        self.keys[instance] = list(keys)
        self._write()

    def _write(self) -> None:
        write_private(self.path, json.dumps(self.keys, indent=1, sort_keys=True) + "\n")
        lines = [f"{','.join(self.addresses[i])} {key}" for i in sorted(self.addresses) for key in self.keys[i]]
        write_private(self.known_hosts, "\n".join(lines) + "\n")

    def own(self, hosts: SshNodes, instances: Mapping[str, str], *, timeout: float) -> None:
        """Every host of ``hosts`` (name -> instance id in ``instances``) that still has the
        bootstrap key makes its own, over the channel pinned to the bootstrap key: the controller
        first (the jump host of the others), then the rest at once."""
        controller, *nodes = hosts.nodes
        for names in ([controller], nodes):
            names = [n for n in names if self.bootstrap in self.keys[instances[n]]]
            made = hosts.each(names, lambda n: _host_key_step(hosts, n, "prepare"))
            for name, key in zip(names, made, strict=True):
                self.pin(instances[name], [*self.keys[instances[name]], key])
            hosts.each(names, lambda n: _host_key_step(hosts, n, "install"))
            for name, key in zip(names, made, strict=True):
                self.pin(instances[name], [key])
            try:
                wait_for_ssh(ssh_hosts(hosts, instances, names), timeout=timeout)
            except InfraError:
                for name, key in zip(names, made, strict=True):  # the next `up` reaches it either way
                    self.pin(instances[name], [self.bootstrap, key])
                raise


def _host_key_step(hosts: SshNodes, name: str, step: str) -> str:
    """One step of ``_OWN_HOST_KEY`` on host ``name``: what it printed (``prepare``: the new key)."""
    done = hosts.run(name, ["sh", "-c", _OWN_HOST_KEY, "own-host-key", step])
    printed = done.stdout.strip().split()
    key = " ".join(printed[:2])
    if done.returncode != 0 or (step == "prepare" and not _HOST_KEY.fullmatch(key)):
        said = proc.last_line(done.stderr) if done.returncode != 0 else f"it printed {done.stdout.strip()[:80]!r}"
        raise InfraError(f"{name} could not make an SSH host key of its own ({step}): {said}; run `infractl up` again")
    return key


def ssh_hosts(hosts: SshNodes, instances: Mapping[str, str], names: Sequence[str]) -> dict[str, tuple[SshLogin, str]]:
    """``wait_for_ssh``'s hosts: ``<name> <instance id>`` -> its login and address."""
    found = {}
    for name in names:
        node = hosts.node(name)
        assert node.ssh is not None  # every host of an aws cluster is reached over SSH
        found[f"{name} {instances[name]}"] = (node.ssh, node.address)
    return found


def wait_for_ssh(hosts: Mapping[str, tuple[SshLogin, str]], *, timeout: float) -> None:
    """Until every host (name -> its login and address) runs a command over SSH, the controller
    first (the nodes are reached through it); ``InfraError`` naming those that never answered
    within ``timeout`` seconds, with what SSH said last."""
    deadline = time.monotonic() + timeout
    said: dict[str, str] = {}
    waiting = dict(hosts)
    while waiting:
        for name, (login, address) in list(waiting.items()):
            try:
                done = proc.run(login.argv(address, "true"), timeout=30)
            except subprocess.TimeoutExpired:
                said[name] = "no answer within 30 s"
                continue
            if done.returncode == 0:
                del waiting[name]
            else:
                said[name] = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        if waiting and time.monotonic() > deadline:
            silent = "; ".join(f"{name} ({said.get(name, 'no attempt')})" for name in waiting)
            raise InfraError(
                f"{len(waiting)} instance(s) did not answer SSH within {timeout:g} s: {silent}; "
                "see their console output (aws ec2 get-console-output), then run `infractl up` again"
            )
        if waiting:
            time.sleep(2)

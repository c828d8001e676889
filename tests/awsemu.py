"""An emulated AWS on this machine, for the tests and by hand (``python tests/awsemu.py``): moto's
standalone server is the AWS API, and a host emulator turns every running EC2 instance into a host.

The VPC is one bridge, ``ixe<id>``, whose host side holds the VPC's first address (the router's, in
AWS's layout) and serves the API there, so the control plane and the instances reach the same
endpoint. The emulator polls DescribeInstances; for each running instance it makes a network
namespace with the instance's private address (on the VPC's prefix, so every subnet of the VPC is
one link), plus its public address where it has one (routed from this machine through the private
one: the controller's public address is how the operator reaches the jump host), and starts an sshd
there from what the instance's ``user_data`` says to cloud-init: the host key (``ssh_keys``, in the
host's own ``/etc/ssh``, where sshd and ``sshd -T`` read it, as on an Ubuntu image) and the login
keys (``ssh_authorized_keys``). A terminated instance's host goes, processes and all.

Each host also has its own mount namespace, so that what a machine keeps to itself is its own:
an empty ``/run``, its instance-store disk at ``/mnt`` (where cloud-init mounts it; a cluster's
``aws.workdir`` goes there), its own ``/etc`` (copied from this machine: accounts, groups, and a
container engine configuration with what this machine's kernel needs: runc, cgroupfs, the hard
ulimits) and its own image store (``/var/lib/containers``). Its instance metadata service answers at
169.254.169.254 inside the namespace (IMDSv2): the instance profile's credentials, and a spot
interruption notice once ``interrupt`` plants one.

infractl is not told: it sees an AWS endpoint and hosts that answer SSH. Emulated hosts share this
machine's users and programs, so a cluster logs in as root (``aws.login_user: root``). Root, Linux,
iproute2, util-linux, openssh-server and podman are needed, as for the netns provider.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import ipaddress
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import boto3
import yaml

from s3server import AWS_TEST_ENV, moto_server

__all__ = [
    "NETWORK_RECORD",
    "STATE_BUCKET",
    "VPC_CIDR",
    "EmulatedAws",
    "cluster_config",
    "emulated_aws",
    "engine_settings",
    "ip",
    "remove_namespace",
    "remove_network",
    "start_sshd",
    "terraform_mirror",
]

#: The emulation's default VPC, and the bucket it makes for the clusters' Terraform state.
VPC_CIDR = "10.77.0.0/16"
STATE_BUCKET = "infractl-state"

_SSHD = "/usr/sbin/sshd"
# The instance metadata service's address, its one token and the instance profile's role name.
_IMDS_ADDRESS = "169.254.169.254"
_IMDS_TOKEN = "emulated-imds-token"
_IMDS_ROLE = "infractl-node"
# The file in a host's folder that holds its planted spot interruption notice.
_SPOT_NOTICE = "spot-instance-action.json"
#: In an emulation's folder while its network exists: the bridge's name, so that what a killed
#: emulation left can be removed later (``remove_network``; tests/conftest.py, for ended sessions).
NETWORK_RECORD = "network.json"
# The most processes a container may have that runc accepted on this machine (as infractl's netns provider).
_MAX_NPROC = 32768
#: Where the machine image keeps the Terraform provider mirror (REFERENCES.md), unless set.
_MIRROR_ENV = "INFRACTL_TF_MIRROR"
_MIRROR_DEFAULT = "/opt/tf-plugins"


def terraform_mirror() -> Path:
    """The Terraform provider filesystem mirror that holds hashicorp/aws on this machine."""
    root = Path(os.environ.get(_MIRROR_ENV, _MIRROR_DEFAULT))
    if not any((root / "registry.terraform.io" / "hashicorp" / "aws").glob("*/linux_amd64")):
        raise RuntimeError(f"no hashicorp/aws provider in a Terraform mirror at {root} (set {_MIRROR_ENV})")
    return root


@dataclass
class _Host:
    instance_id: str
    namespace: str
    veth: str
    private_ip: str
    public_ip: str | None
    folder: Path
    sshd_pid: int | None


class EmulatedAws:
    """moto's server plus the hosts of its running instances (see the module's docstring)."""

    def __init__(self, folder: Path, vpc_cidr: str) -> None:
        self.folder = folder
        self.network = ipaddress.IPv4Network(vpc_cidr)
        self.router = str(self.network.network_address + 1)
        self.id = hashlib.sha256(str(folder).encode()).hexdigest()[:6]
        self.bridge = f"ixe{self.id}"
        self.endpoint = ""
        self.image_id = ""
        self.hosts: dict[str, _Host] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._next_index = 0
        self._skipped: set[str] = set()

    # -- the VPC's link ------------------------------------------------------------------------

    def open_network(self) -> None:
        """The VPC's bridge. Refused while another link routes into the VPC: this machine's replies
        to the hosts would leave on that link, and no host would reach the endpoint."""
        routed = _links_routing(self.network)
        if routed:
            raise RuntimeError(
                f"{self.network} is already routed on this machine (via {', '.join(routed)}): another emulation "
                "is up, or a killed one left its bridge (remove_network removes it, given that one's folder)"
            )
        (self.folder / NETWORK_RECORD).write_text(json.dumps({"bridge": self.bridge}))
        ip("link", "add", self.bridge, "type", "bridge")
        ip("addr", "add", f"{self.router}/{self.network.prefixlen}", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")

    def close_network(self) -> None:
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, check=False)
        (self.folder / NETWORK_RECORD).unlink(missing_ok=True)

    def client(self, service: str) -> Any:
        return boto3.client(service, endpoint_url=self.endpoint, region_name=AWS_TEST_ENV["AWS_DEFAULT_REGION"])

    def register_image(self) -> str:
        """An AMI for every instance type (the clusters pin it with ``aws.ami_overrides``)."""
        image = self.client("ec2").register_image(
            Name="infractl-emulated-ubuntu-24.04",
            Architecture="x86_64",
            RootDeviceName="/dev/sda1",
            VirtualizationType="hvm",
        )
        self.image_id = str(image["ImageId"])
        return self.image_id

    # -- hosts ---------------------------------------------------------------------------------

    def sync(self) -> None:
        """Make the hosts match the running instances (one pass)."""
        with self._lock:
            ec2 = self.client("ec2")
            running: dict[str, dict[str, Any]] = {}
            for page in ec2.get_paginator("describe_instances").paginate():
                for reservation in page["Reservations"]:
                    for instance in reservation["Instances"]:
                        address = instance.get("PrivateIpAddress")
                        state = instance["State"]["Name"]
                        if state == "running" and address and ipaddress.IPv4Address(address) in self.network:
                            running[instance["InstanceId"]] = instance
                        elif instance["InstanceId"] not in self._skipped and state != "terminated":
                            self._skipped.add(instance["InstanceId"])
                            self._log(f"not a host: {instance['InstanceId']} ({state}, address {address})")
            for instance_id in sorted(set(self.hosts) - set(running)):
                self._log(f"removing {instance_id}")
                self._remove(self.hosts.pop(instance_id))
            taken = {host.private_ip: host.instance_id for host in self.hosts.values()}
            for instance_id, instance in sorted(running.items()):
                address = instance["PrivateIpAddress"]
                if instance_id not in self.hosts and taken.get(address, instance_id) != instance_id:
                    # Two VPCs of one CIDR: their hosts would share an address on the one emulated link.
                    if instance_id not in self._skipped:
                        self._skipped.add(instance_id)
                        self._log(f"not a host: {instance_id} ({address} is {taken[address]}'s)")
                    continue
                if instance_id not in self.hosts:
                    self._log(f"adding {instance_id} at {instance['PrivateIpAddress']}")
                    self.hosts[instance_id] = self._add(ec2, instance)

    def _log(self, line: str) -> None:
        with (self.folder / "emulator.log").open("a") as log:
            log.write(f"{time.strftime('%H:%M:%S')} {line}\n")

    def _add(self, ec2: Any, instance: dict[str, Any]) -> _Host:
        index = self._next_index
        self._next_index += 1
        host = _Host(
            instance_id=instance["InstanceId"],
            namespace=f"ixe{self.id}-{index}",
            veth=f"ixe{self.id}h{index}",
            private_ip=instance["PrivateIpAddress"],
            public_ip=instance.get("PublicIpAddress"),
            folder=self.folder / "hosts" / instance["InstanceId"],
            sshd_pid=None,
        )
        host.folder.mkdir(parents=True, mode=0o700, exist_ok=True)
        try:
            self._make(ec2, host)
        except Exception:
            self._remove(host)  # half made: the next pass makes it anew
            raise
        return host

    def _make(self, ec2: Any, host: _Host) -> None:
        ip("netns", "add", host.namespace)
        ip("link", "add", host.veth, "type", "veth", "peer", "name", "eth0", "netns", host.namespace)
        ip("link", "set", host.veth, "master", self.bridge, "up")
        ip("-n", host.namespace, "addr", "add", f"{host.private_ip}/{self.network.prefixlen}", "dev", "eth0")
        if host.public_ip:
            ip("-n", host.namespace, "addr", "add", f"{host.public_ip}/32", "dev", "eth0")
        ip("-n", host.namespace, "link", "set", "eth0", "up")
        ip("-n", host.namespace, "link", "set", "lo", "up")
        ip("-n", host.namespace, "route", "add", "default", "via", self.router)
        if host.public_ip:
            ip("route", "replace", f"{host.public_ip}/32", "via", host.private_ip, "dev", self.bridge)
        raw = ec2.describe_instance_attribute(InstanceId=host.instance_id, Attribute="userData")
        encoded = raw.get("UserData", {}).get("Value")
        cloud_config = _cloud_config(base64.b64decode(encoded).decode() if encoded else "")
        if cloud_config.get("ssh_keys") and cloud_config.get("ssh_authorized_keys"):
            host.sshd_pid = self._start_sshd(host, cloud_config)
        ip("-n", host.namespace, "addr", "add", f"{_IMDS_ADDRESS}/32", "dev", "lo")
        subprocess.Popen(
            ["nsenter", f"--net=/run/netns/{host.namespace}", sys.executable, __file__, "imds"]
            + ["--folder", str(host.folder), "--instance", host.instance_id],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=(host.folder / "imds.log").open("ab"),
            start_new_session=True,
        )

    def interrupt(self, instance_id: str, *, action: str = "terminate", in_s: float = 120) -> None:
        """Plant a spot interruption notice in the instance's metadata service, as EC2 does two
        minutes before it reclaims a spot instance."""
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + in_s))
        notice = self.hosts[instance_id].folder / _SPOT_NOTICE
        notice.write_text(json.dumps({"action": action, "time": when}))

    def _start_sshd(self, host: _Host, cloud_config: dict[str, Any]) -> int:
        # As cloud-init and an Ubuntu image do: the host's own /etc/ssh holds sshd's configuration and
        # user data's host key in place of the image's keys (ssh_deletekeys), where `sshd -T` on the
        # host finds them (infractl has each host replace that key with one of its own).
        mounts = _private_folders(host.folder)
        etc_ssh = mounts["/etc"] / "ssh"
        etc_ssh.mkdir(exist_ok=True)
        for key in etc_ssh.glob("ssh_host_*"):
            key.unlink()
        keys = cloud_config["ssh_keys"]
        host_key = etc_ssh / "ssh_host_ed25519_key"
        host_key.write_text(keys["ed25519_private"])
        host_key.chmod(0o600)
        host_key.with_name(f"{host_key.name}.pub").write_text(keys["ed25519_public"] + "\n")
        authorized = host.folder / "authorized_keys"
        authorized.write_text("".join(f"{key}\n" for key in cloud_config["ssh_authorized_keys"]))
        (etc_ssh / "sshd_config").write_text(
            "ListenAddress 0.0.0.0\nHostKey /etc/ssh/ssh_host_ed25519_key\n"
            f"PidFile {host.folder / 'sshd.pid'}\n"
            f"AuthorizedKeysFile {authorized}\nAllowUsers root\nPermitRootLogin prohibit-password\n"
            "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
            # The controller is the jump host: ssh -W needs TCP forwarding.
            "AllowTcpForwarding yes\nX11Forwarding no\nLogLevel VERBOSE\nSubsystem sftp internal-sftp\n"
        )
        return start_sshd(host.namespace, host.folder, mounts)

    def _remove(self, host: _Host) -> None:
        if host.public_ip:
            subprocess.run(["ip", "route", "del", f"{host.public_ip}/32"], capture_output=True, check=False)
        remove_namespace(host.namespace, {host.sshd_pid} if host.sshd_pid else set())

    def watch(self, interval: float = 0.5) -> threading.Thread:
        """Sync in a thread until ``stop``."""

        def loop() -> None:
            while not self._stop.wait(interval):
                try:
                    self.sync()
                except Exception as exc:  # the API mid-restart, a host half made: next pass
                    self._log(f"sync failed: {exc!r}")

        thread = threading.Thread(target=loop, name="awsemu", daemon=True)
        thread.start()
        return thread

    def stop(self) -> None:
        """Remove every host, and any namespace of this emulation a failure left unrecorded."""
        self._stop.set()
        with self._lock:
            for host in self.hosts.values():
                self._remove(host)
            self.hosts.clear()
            _remove_namespaces(f"{self.bridge}-")


def start_sshd(namespace: str, folder: Path, mounts: dict[str, Path]) -> int:
    """sshd in the network namespace ``namespace`` and a mount namespace of its own, where each
    path of ``mounts`` is the host's folder it maps to and ``/run`` is empty, so that every session
    it opens sees the host's folders; its configuration is the host's ``/etc/ssh`` (among
    ``mounts``), its log and pid file in ``folder``. Its pid."""
    script = " && ".join(
        [
            "mount -t tmpfs -o mode=0755 host-run /run",
            "mkdir -m 0755 /run/sshd && mkdir -m 1777 /run/lock",
            # A machine that never ran podman has no /var/lib/containers to mount over.
            *(f"mkdir -p {point} && mount --bind {source} {point}" for point, source in mounts.items()),
            f"exec {_SSHD} -E {folder / 'sshd.log'}",
        ]
    )
    started = subprocess.run(
        ["nsenter", f"--net=/run/netns/{namespace}", "unshare", "--mount", "--propagation", "private"]
        + ["sh", "-c", script],
        capture_output=True,
        text=True,
        check=False,
    )
    if started.returncode != 0:
        raise RuntimeError(f"sshd of {namespace} did not start: {started.stderr.strip()}")
    # sshd's daemon writes its pid file a moment after the command that started it returns.
    pid_file = folder / "sshd.pid"
    deadline = time.monotonic() + 10
    while not (pid_file.is_file() and pid_file.read_text().strip()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"sshd of {namespace} wrote no pid file; see {folder / 'sshd.log'}")
        time.sleep(0.05)
    return int(pid_file.read_text().strip())


def engine_settings(etc: Path) -> None:
    """The container engine's configuration in a host's own ``/etc`` (``etc``): what this machine's
    kernel needs, as a machine image would ship it. crun refuses this machine's hybrid cgroup
    mounts, there is no systemd, and podman would raise the limits past the hard ones, which this
    machine refuses."""
    nproc = resource.getrlimit(resource.RLIMIT_NPROC)[1]
    nproc = _MAX_NPROC if nproc == resource.RLIM_INFINITY else min(nproc, _MAX_NPROC)
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    (etc / "containers" / "containers.conf").write_text(
        f'[containers]\ndefault_ulimits = ["nofile={nofile}:{nofile}", "nproc={nproc}:{nproc}"]\n'
        '[engine]\nruntime = "runc"\ncgroup_manager = "cgroupfs"\nevents_logger = "file"\n'
    )


def _private_folders(folder: Path) -> dict[str, Path]:
    """A host's own folders (made in ``folder``), by the path it sees each at: its instance-store
    disk, its image store, and its ``/etc`` (this machine's, copied: its accounts and groups are
    its own, and its container engine's configuration says what this machine's kernel needs, as
    an AMI would ship it)."""
    disk, store, etc = folder / "mnt", folder / "containers", folder / "etc"
    disk.mkdir(exist_ok=True)
    store.mkdir(exist_ok=True)
    if not etc.is_dir():  # a host made again in its folder (a retried start) keeps its /etc, as its disk would
        shutil.copytree("/etc", etc, symlinks=True)
    engine_settings(etc)
    return {"/mnt": disk, "/var/lib/containers": store, "/etc": etc}


class _Metadata(BaseHTTPRequestHandler):
    """An instance's metadata service, IMDSv2 only (the launch template requires tokens): its id,
    region and zone, its instance profile's credentials (moto takes any), and the spot
    interruption notice when one was planted (404 until then, as on EC2)."""

    folder: Path
    instance: str

    def do_PUT(self) -> None:
        if self.path != "/latest/api/token" or "X-aws-ec2-metadata-token-ttl-seconds" not in self.headers:
            self._answer(400, "")
            return
        self._answer(200, _IMDS_TOKEN)

    def do_GET(self) -> None:
        if self.headers.get("X-aws-ec2-metadata-token") != _IMDS_TOKEN:
            self._answer(401, "")
            return
        expires = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 6 * 3600))
        credentials = {
            "Code": "Success",
            "Type": "AWS-HMAC",
            "AccessKeyId": AWS_TEST_ENV["AWS_ACCESS_KEY_ID"],
            "SecretAccessKey": AWS_TEST_ENV["AWS_SECRET_ACCESS_KEY"],
            "Token": "emulated",
            "Expiration": expires,
            "LastUpdated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        notice = self.folder / _SPOT_NOTICE
        answers = {
            "/latest/meta-data/instance-id": self.instance,
            "/latest/meta-data/placement/region": AWS_TEST_ENV["AWS_DEFAULT_REGION"],
            "/latest/meta-data/placement/availability-zone": AWS_TEST_ENV["AWS_DEFAULT_REGION"] + "a",
            "/latest/meta-data/iam/security-credentials/": _IMDS_ROLE,
            f"/latest/meta-data/iam/security-credentials/{_IMDS_ROLE}": json.dumps(credentials),
            "/latest/meta-data/spot/instance-action": notice.read_text() if notice.is_file() else None,
        }
        answer = answers.get(self.path)
        self._answer(200 if answer is not None else 404, answer or "")

    def _answer(self, status: int, body: str) -> None:
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        sys.stderr.write(f"{time.strftime('%H:%M:%S')} {format % args}\n")


def _serve_metadata(folder: Path, instance: str) -> None:
    """Serve an instance's metadata at 169.254.169.254:80 in the network namespace it was started in."""
    _Metadata.folder, _Metadata.instance = folder, instance
    ThreadingHTTPServer((_IMDS_ADDRESS, 80), _Metadata).serve_forever()


def cluster_config(
    name: str,
    endpoint: str,
    ami: str,
    groups: dict[str, Any],
    *,
    image: str,
    vpc_cidr: str = VPC_CIDR,
    **aws_fields: Any,
) -> dict[str, Any]:
    """An aws cluster.yaml (as a mapping) for an emulated AWS at ``endpoint`` whose instances run
    ``ami``: a bucket of its own for the store (``<name>-store``, made with the cluster), the
    state in ``STATE_BUCKET``, the provider from this machine's mirror, the work directory on the
    instances' own disk (``/mnt``), logging in as root (the emulated hosts share this machine's
    users) from the VPC's router address (where this machine is on the VPC's link)."""
    network = ipaddress.IPv4Network(vpc_cidr)
    types = {group["instance_type"] for group in groups.values()} | {"m7i.large"}
    return {
        "name": name,
        "provider": "aws",
        "nodes": sum(group["nodes"] for group in groups.values()),
        "store": f"s3://{name}-store/runs?endpoint_url={endpoint}&region={AWS_TEST_ENV['AWS_DEFAULT_REGION']}",
        "aws": {
            "region": AWS_TEST_ENV["AWS_DEFAULT_REGION"],
            "state_bucket": STATE_BUCKET,
            "availability_zone": AWS_TEST_ENV["AWS_DEFAULT_REGION"] + "a",
            "vpc_cidr": str(network),
            "node_groups": groups,
            "create_bucket": True,
            "ssh_ingress_cidrs": [f"{network.network_address + 1}/32"],
            "login_user": "root",
            "endpoint_url": endpoint,
            "provider_mirror": str(terraform_mirror()),
            "ami_overrides": dict.fromkeys(sorted(types), ami),
            "workdir": "/mnt/infractl",
            "ssh_timeout_s": 120,
            **aws_fields,
        },
        "runtime": {"image": image},
    }


def _cloud_config(user_data: str) -> dict[str, Any]:
    if not user_data.startswith("#cloud-config"):
        return {}
    loaded = yaml.safe_load(user_data)
    return loaded if isinstance(loaded, dict) else {}


def remove_network(folder: Path) -> None:
    """What an emulation whose process was killed left in ``folder``'s name (its ``NETWORK_RECORD``):
    its hosts' namespaces, their processes killed by PID, and its bridge with the routes through it."""
    record = folder / NETWORK_RECORD
    if not record.is_file():
        return
    bridge = json.loads(record.read_text())["bridge"]
    _remove_namespaces(f"{bridge}-")
    subprocess.run(["ip", "link", "del", bridge], capture_output=True, check=False)
    record.unlink()


def _remove_namespaces(prefix: str) -> None:
    listed = subprocess.run(["ip", "-json", "netns", "list"], capture_output=True, text=True, check=False)
    for entry in json.loads(listed.stdout or "[]"):
        if entry["name"].startswith(prefix):
            remove_namespace(entry["name"], set())


def remove_namespace(namespace: str, pids: set[int]) -> None:
    """Kill what runs in ``namespace`` (and ``pids``), then remove it. Its link goes first: a process
    that escaped the kill would keep the namespace, and its address on the VPC's link, alive."""
    listed = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True, check=False)
    for pid in {int(p) for p in listed.stdout.split()} | pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
    subprocess.run(["ip", "-n", namespace, "link", "del", "eth0"], capture_output=True, check=False)
    subprocess.run(["ip", "netns", "del", namespace], capture_output=True, check=False)


def _links_routing(network: ipaddress.IPv4Network) -> list[str]:
    """The links of this machine's routes to ``network`` or a part of it: those the VPC's own
    route would not win against (a wider one, a VPN's 10.0.0.0/8 say, loses to it)."""
    listed = subprocess.run(["ip", "-json", "route", "show"], capture_output=True, text=True, check=True)
    return sorted(
        {
            route.get("dev", "?")
            for route in json.loads(listed.stdout or "[]")
            if route["dst"] != "default" and ipaddress.IPv4Network(route["dst"], strict=False).subnet_of(network)
        }
    )


def ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


@contextmanager
def emulated_aws(folder: Path, vpc_cidr: str) -> Iterator[EmulatedAws]:
    """An emulated AWS whose VPC is ``vpc_cidr`` (the cluster's ``aws.vpc_cidr``), its files in
    ``folder``; everything it made is gone when the block ends."""
    folder.mkdir(parents=True, exist_ok=True)
    remove_network(folder)  # what an emulation killed in this folder left
    emulation = EmulatedAws(folder, vpc_cidr)
    emulation.open_network()
    watcher = None
    try:
        # AWS's managed policies (the module attaches two) exist only when moto loads them.
        env = {"MOTO_IAM_LOAD_MANAGED_POLICIES": "true"}
        with moto_server(folder / "moto.log", env=env, host=emulation.router) as endpoint:
            emulation.endpoint = endpoint
            emulation.register_image()
            watcher = emulation.watch()
            try:
                yield emulation
            finally:
                emulation.stop()
                watcher.join(timeout=10)
    finally:
        emulation.close_network()


def main() -> None:
    parser = argparse.ArgumentParser(description="An emulated AWS on this machine (root): moto and instance hosts.")
    parser.add_argument("--vpc-cidr", default=VPC_CIDR, help="the cluster's aws.vpc_cidr")
    parser.add_argument("--folder", default=".infractl/awsemu", help="where its files go")
    parser.add_argument("--cluster", type=Path, help="write a cluster.yaml for this emulation here (2 c7i nodes)")
    parser.add_argument("--image", help="the cluster.yaml's runtime.image (what `infractl image build` pinned)")
    # The emulator starts itself with these, in a host's namespace, as that host's metadata service.
    parser.add_argument("role", nargs="?", choices=["imds"], help=argparse.SUPPRESS)
    parser.add_argument("--instance", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "imds":
        _serve_metadata(Path(args.folder), args.instance)
        return
    os.environ.update(AWS_TEST_ENV)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # `kill PID` cleans up as Ctrl-C does
    if args.cluster is not None and args.image is None:
        parser.error("--cluster needs --image (the digest `infractl image build` printed)")
    with emulated_aws(Path(args.folder).resolve(), args.vpc_cidr) as emulation:
        emulation.client("s3").create_bucket(Bucket=STATE_BUCKET)
        if args.cluster is not None:
            groups = {"main": {"instance_type": "c7i.4xlarge", "nodes": 2}}
            config = cluster_config(
                args.cluster.stem,
                emulation.endpoint,
                emulation.image_id,
                groups,
                image=args.image,
                vpc_cidr=args.vpc_cidr,
            )
            args.cluster.write_text(yaml.safe_dump(config, sort_keys=False))
        print(
            json.dumps(
                {
                    "endpoint_url": emulation.endpoint,
                    "ami": emulation.image_id,
                    "cluster": str(args.cluster) if args.cluster else None,
                    "environment": {k: AWS_TEST_ENV[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")},
                },
                indent=2,
            ),
            flush=True,
        )
        print("emulated AWS running; Ctrl-C stops it and removes every host", file=sys.stderr, flush=True)
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()

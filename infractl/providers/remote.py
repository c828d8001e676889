"""Node control over SSH, for providers whose nodes are other machines (or stand in for them, as a
netns node does): every command runs in a session on the node, logged in with the node's
``SshLogin`` (its host key pinned), and what the control plane asks of a node's processes is
answered by infractl's node side there (``python -m infractl.proc``), as JSON.

A node that does not answer (its link is down, say) is left out of a listing and named in
``unreachable``; its processes are not known, not gone.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar

from infractl import proc
from infractl.errors import InfractlError, UsageError
from infractl.node import Node, SshLogin
from infractl.proc import NodeProcess
from infractl.providers.engines import IMAGE_PYTHON, ContainerEngine
from infractl.providers.nodecontrol import NETEM_HINT, NodeControl, Watch
from infractl.providers.servers import SERVER_START_S, ServerHost, free_port, port_open
from infractl.statedir import ClusterState
from infractl.workdir import WORK, run_private

__all__ = ["SYSTEM_PYTHON", "ImageNodes", "RemoteServers", "SshNodes"]

# Environment variables a POSIX shell can set: the rest stay behind on an SSH node.
_SHELL_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Seconds one question to a node may take (a node whose link is down never answers).
_ASK_TIMEOUT_S = 20.0
# Variables of the session that describe the node's own system, not the run: a container keeps the
# image's (its PATH finds the image's Python).
_HOST_ONLY = frozenset(
    {"PATH", "HOME", "PWD", "OLDPWD", "SHLVL", "HOSTNAME", "VIRTUAL_ENV", "PYTHONHOME", "PYTHONPATH"}
)
# ssh's own exit code when it could not connect (or the session broke).
_SSH_FAILED = 255
# The iptables chains a ``drop`` fault puts first in INPUT and OUTPUT (one of each on a node).
_CUT_CHAINS = {"INPUT": ("INFRACTL-CUT-IN", "--dport"), "OUTPUT": ("INFRACTL-CUT-OUT", "--sport")}
# The device of the node's default route (where a ``delay`` fault's netem goes).
_DEFAULT_DEVICE = "dev=$(ip -o -4 route show to default | awk '{print $5; exit}') && test -n \"$dev\""
#: A Linux distribution's own Python (Debian, Ubuntu): what Ansible runs its modules with on a host
#: that has no infractl. By its path: the first ``python3`` on a login's PATH may be anything (a
#: pyenv shim that writes to stdout while it rehashes, say).
SYSTEM_PYTHON = "/usr/bin/python3"


class SshNodes(NodeControl):
    """Nodes reached over SSH; ``python`` is the interpreter infractl runs with on them. A login
    that is not root runs every command with sudo (the node's, passwordless: a cloud image's
    login user has it)."""

    #: Variables of the control plane's environment that never go to a node (``start``).
    withheld: frozenset[str] = frozenset()
    #: Made by the node itself, in iptables and tc. Never ``down``: the drill's own session, which
    #: restores the link, runs over it.
    link_faults: ClassVar[tuple[str, ...]] = ("drop", "delay")
    guards_ports = True

    def __init__(self, state: ClusterState, nodes: Sequence[Node], *, python: str) -> None:
        super().__init__(state, nodes)
        self._python = python

    def python(self, node: str) -> str:
        return self._python

    def _login(self, node: str) -> tuple[SshLogin, str]:
        entry = self.node(node)
        if entry.ssh is None:
            raise InfractlError(f"node {node!r} has no SSH login in the cluster record")
        return entry.ssh, entry.address

    def _session(self, node: str, command: str) -> list[str]:
        login, address = self._login(node)
        if login.user != "root":
            command = f"sudo -n sh -c {shlex.quote(command)}"
        return login.argv(address, command)

    def _ask(
        self, node: str, command: str, *, timeout: float = _ASK_TIMEOUT_S, input: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run the shell ``command`` on ``node``; a node that does not answer counts as unreachable."""
        argv = self._session(node, command)
        try:
            done = proc.run(argv, timeout=timeout, input=input)
        except subprocess.TimeoutExpired:
            done = subprocess.CompletedProcess(argv, _SSH_FAILED, "", f"no answer within {timeout:g}s")
        if done.returncode == _SSH_FAILED:
            self.unreachable.add(node)
        return done

    def _node_side(self, node: str, *args: str) -> list[str]:
        return [self.python(node), "-m", "infractl.proc", *args]

    # -- commands and files ---------------------------------------------------------------------

    def run(self, node: str, argv: Sequence[str], *, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        return self._ask(node, shlex.join(argv), timeout=timeout)

    def write_file(self, node: str, path: Path, text: str) -> None:
        part = path.with_name(f".{path.name}.part")
        command = (
            f"umask 077 && mkdir -p {shlex.quote(str(path.parent))} && cat >{shlex.quote(str(part))} && "
            f"mv -f {shlex.quote(str(part))} {shlex.quote(str(path))}"
        )
        done = self._ask(node, command, input=text)
        if done.returncode != 0:
            raise InfractlError(f"cannot write {path} on {node}: {proc.last_line(done.stderr)}")

    def _read(self, node: str, command: str, path: Path) -> str | None:
        quoted = shlex.quote(str(path))
        done = self._ask(node, f"test -f {quoted} || exit 3; {command} {quoted}")
        if done.returncode == 3:
            return None
        if done.returncode != 0:
            raise InfractlError(f"cannot read {path} on {node}: {proc.last_line(done.stderr)}")
        return done.stdout

    def read_file(self, node: str, path: Path) -> str | None:
        return self._read(node, "cat --", path)

    def tail(self, node: str, path: Path, *, lines: int) -> list[str] | None:
        text = self._read(node, f"tail -n {lines} --" if lines else "cat --", path)
        return None if text is None else text.splitlines(keepends=True)

    def tail_bytes(self, node: str, path: Path, *, size: int) -> bytes:
        try:
            text = self._read(node, f"tail -c {size} --", path)
        except InfractlError:
            return b""
        return (text or "").encode()

    # -- the agent ------------------------------------------------------------------------------

    def start(
        self,
        node: str,
        argv: Sequence[str],
        env: Mapping[str, str],
        *,
        workdir: Path,
        log_path: Path,
        header: str,
        image: str | None = None,
        mounts: Sequence[Path] = (),
        files: Mapping[Path, Path] | None = None,
    ) -> subprocess.Popen[bytes]:
        """sshd gives a session a clean environment, so the agent's comes from a 0600 file in the
        node's root-only ``private/`` folder (never a command line, where every user could read its
        secrets), removed as soon as the session has read it. The agent writes its log itself: a
        link that goes down must not stall it on a full SSH channel. ``files`` are made readable
        for the container's user to open where they are mounted: the root-only folder they lie in
        keeps everyone else of the node out.

        The ssh client stays connected and exits with the agent's code, so ``train`` follows an SSH
        node as it follows a local one; it carries none of the markers, so a node whose link is cut
        counts as stopped once its agent has exited, whatever the client waits for."""
        names = sorted(k for k in env if _SHELL_NAME.match(k) and k not in self.withheld)
        env_file = run_private(workdir, env[proc.RUN_ENV]) / "agent.env"
        self.write_file(node, env_file, "".join(f"{k}={shlex.quote(env[k])}\n" for k in names))
        readable = ""
        if image is not None:
            passed = [k for k in names if k not in _HOST_ONLY]
            argv = self._in_container(node, image, argv, env[proc.RUN_ENV], passed, workdir, mounts, files or {})
            readable = "".join(f"chmod 0644 -- {shlex.quote(str(path))} && " for path in files or {})
        log = shlex.quote(str(log_path))
        command = (
            f"mkdir -p {shlex.quote(str(log_path.parent))} && echo {shlex.quote(header)} >>{log} && {readable}"
            f"set -a && . {shlex.quote(str(env_file))} && set +a && rm -f -- {shlex.quote(str(env_file))} && "
            f"cd {shlex.quote(str(workdir))} && "
            f"exec {shlex.join(argv)} >>{log} 2>&1 </dev/null"
        )
        markers = (proc.CLUSTER_ENV, proc.NODE_ENV, proc.RUN_ENV)
        return proc.spawn(
            self._session(node, command),
            env={k: v for k, v in os.environ.items() if k not in markers},
            cwd=self.state.dir,
            # The session's own messages (a refused login, a broken link); the agent's are on the node.
            log_path=self.state.dir / "sessions" / f"{env[proc.RUN_ENV]}-{node}.log",
        )

    def _in_container(
        self,
        node: str,
        image: str,
        argv: Sequence[str],
        run: str,
        env: Sequence[str],
        workdir: Path,
        mounts: Sequence[Path],
        files: Mapping[Path, Path],
    ) -> list[str]:
        """``argv`` in a confined container of ``image`` by the node's engine, with the environment
        the session sourced (``env``: the variables' names), the trainer's own folder of the work
        directory (the rest of it is root's: the container's user could not enter it) and the other
        folders it works in, and ``files``; named and labelled after the cluster, the run and the
        node."""
        prefix = self.containers(node).run_prefix(
            name=f"infractl-{run}-{node}",
            labels={"org.infractl.cluster": str(self.state.dir), "org.infractl.run": run, "org.infractl.node": node},
            env=env,
            volumes=[workdir / WORK, *mounts],
            files=files,
            workdir=workdir / WORK,
            confined=True,
        )
        return [*prefix, image, *argv]

    # -- processes ------------------------------------------------------------------------------

    def processes(self, *, node: str | None = None, run: str | None = None) -> list[NodeProcess]:
        def ask(name: str) -> list[NodeProcess]:
            args = ["list", "--cluster", str(self.state.dir), "--node", name, *(["--run", run] if run else [])]
            done = self._ask(name, shlex.join(self._node_side(name, *args)))
            if done.returncode != 0:
                self.unreachable.add(name)
                return []
            self.unreachable.discard(name)
            return [NodeProcess(**item) for item in json.loads(done.stdout)]

        listed = self.each([node] if node is not None else self.nodes, ask)
        return [p for procs in listed for p in procs]

    def signal(self, procs: Iterable[NodeProcess], sig: int) -> None:
        by_node: dict[str, list[NodeProcess]] = {}
        for p in procs:
            by_node.setdefault(p.node, []).append(p)

        def ask(name: str) -> None:
            named = [f"{p.node}:{p.pid}:{p.started!r}" for p in by_node[name]]
            self._ask(name, shlex.join(self._node_side(name, "signal", "--sig", str(sig), *named)))

        self.each(by_node, ask)

    def watch(self, run: str) -> Watch:
        return _SshWatch(self, run)

    def kill_node(self, node: str, run: str) -> None:
        """The run's processes on the node, found and killed until none is left by the node itself
        (``python -m infractl.proc kill``: one session, not a listing's round trip late)."""
        args = ["kill", "--cluster", str(self.state.dir), "--node", node, "--run", run]
        self._ask(node, shlex.join(self._node_side(node, *args)))

    def _link_scripts(self, fault: str, latency_ms: int) -> tuple[str, str]:
        """The shell script that makes ``fault`` on a node, and the one that undoes it. ``drop``
        discards every packet but loopback's and SSH's (port 22, the drill's own path);
        ``delay`` puts netem on the default route's device."""
        if fault == "drop":
            make, undo = [], []
            for hook, (chain, port) in _CUT_CHAINS.items():
                lo = "-i" if hook == "INPUT" else "-o"
                make += [
                    f"iptables -w -N {chain}",
                    f"iptables -w -A {chain} {lo} lo -j RETURN",
                    f"iptables -w -A {chain} -p tcp {port} 22 -j RETURN",
                    f"iptables -w -A {chain} -j DROP",
                    f"iptables -w -I {hook} 1 -j {chain}",
                ]
                undo += [f"iptables -w -D {hook} -j {chain}", f"iptables -w -F {chain}", f"iptables -w -X {chain}"]
            return " && ".join(make), "; ".join(undo)
        tc = 'tc qdisc {} dev "$dev" root'
        return (
            f"{_DEFAULT_DEVICE} && {tc.format('add')} netem delay {latency_ms}ms",
            f"{_DEFAULT_DEVICE} && {tc.format('del')}",
        )

    def cut_link(self, node: str, fault: str, *, latency_ms: int = 0) -> dict[str, Any]:
        make, undo = self._link_scripts(fault, latency_ms)
        done = self._ask(node, make)
        if done.returncode != 0:
            self._ask(node, undo)  # whatever part of it was made
            hint = NETEM_HINT if fault == "delay" else ""
            raise UsageError(
                f"cannot make a {fault!r} fault on {node}: {proc.last_line(done.stderr)}{hint}", field="--kind"
            )
        return {"link": fault, "node": node} | ({"latency_ms": latency_ms} if fault == "delay" else {})

    def restore_link(self, node: str, fault: str) -> None:
        _, undo = self._link_scripts(fault, 0)
        done = self._ask(node, undo)
        if done.returncode != 0:
            raise InfractlError(
                f"could not restore {node}'s link after a {fault!r} fault: {proc.last_line(done.stderr)}; run on the "
                f"node: {undo}"
            )

    # -- configuration --------------------------------------------------------------------------

    def ansible_host(self, node: str) -> dict[str, Any]:
        login, address = self._login(node)
        return {
            "ansible_connection": "ssh",
            "ansible_host": address,
            "ansible_user": login.user,
            "ansible_port": login.port,
            "ansible_ssh_private_key_file": str(login.identity_file),
            "ansible_ssh_common_args": shlex.join(login.options()),
            "ansible_python_interpreter": self.python(node),
            "ansible_become": login.user != "root",
        }


class ImageNodes(SshNodes):
    """SSH nodes with no infractl of their own (a cloud instance, a team's machine): Ansible runs
    with the host's own Python, infractl's node side from the cluster's image, in a container that
    shares the node's namespaces, as the trainer does."""

    def __init__(self, state: ClusterState, nodes: Sequence[Node]) -> None:
        super().__init__(state, nodes, python=SYSTEM_PYTHON)
        self._image: str | None = None

    def _node_side(self, node: str, *args: str) -> list[str]:
        if self._image is None:
            self._image = self.state.record().image
            if self._image is None:
                raise InfractlError(f"cluster {self.state.name!r} records no image: its nodes were never configured")
        prefix = self.containers(node).run_prefix()
        return [*prefix, "--interactive", self._image, IMAGE_PYTHON, "-m", "infractl.proc", *args]


class _SshWatch(Watch):
    """One monitor per node, each in its own SSH session, read by a thread per node. A session
    that ends while the watch is open (the node was killed, its link broke) is opened again."""

    # Seconds between attempts to open a node's monitor again.
    _RETRY_S = 1.0

    def __init__(self, nodes: SshNodes, run: str) -> None:
        super().__init__(nodes.nodes)
        self._control, self._run = nodes, run
        self._closing = threading.Event()
        self._sessions_lock = threading.Lock()
        self._sessions: dict[str, subprocess.Popen[str]] = {}
        self._threads = [threading.Thread(target=self._follow, args=(name,), daemon=True) for name in nodes.nodes]
        for thread in self._threads:
            thread.start()

    def _follow(self, node: str) -> None:
        args = ["monitor", "--cluster", str(self._control.state.dir), "--node", node, "--run", self._run]
        command = self._control._session(node, shlex.join(self._control._node_side(node, *args)))
        while not self._closing.is_set():
            with self._sessions_lock:
                if self._closing.is_set():
                    return
                session = subprocess.Popen(
                    command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
                )
                self._sessions[node] = session
            assert session.stdout is not None
            for line in session.stdout:
                try:
                    reported = json.loads(line)
                except ValueError:
                    continue
                if reported is not None:
                    self.report(node, [NodeProcess(**item) for item in reported])
            session.wait()
            self._closing.wait(self._RETRY_S)

    def close(self) -> None:
        with self._sessions_lock:
            self._closing.set()
            sessions = list(self._sessions.values())
        for session in sessions:
            if session.stdin is not None:
                session.stdin.close()  # the monitor on the node ends with its stdin
        for session in sessions:
            try:
                session.wait(timeout=5)
            except subprocess.TimeoutExpired:
                session.kill()  # a node that does not answer: its monitor ends with the session
                session.wait()
        for thread in self._threads:
            thread.join(timeout=5)


class RemoteServers(ServerHost):
    """The cluster's servers on a host of the cluster that trains nothing (a controller instance),
    reached over SSH like a node. A Python server runs in a container of the cluster's image
    (``pull`` puts it there), the registry as a process of the host's own (its pid in
    ``<home>/run/``); each listens on the port ``ports`` gives it. This machine reaches a server's
    port through an SSH tunnel (``reach``): the host's private address is not this machine's
    network."""

    python = IMAGE_PYTHON
    runs_image = True

    def __init__(self, state: ClusterState, host: Node, *, engine: ContainerEngine, ports: Mapping[str, int]) -> None:
        self.state = state
        self.home = host.workdir
        self._host = SshNodes(state, [host], python=SYSTEM_PYTHON)
        self._name = host.name
        self._engine = engine
        self._ports = dict(ports)

    def new_port(self, name: str, host: str) -> int:
        return self._ports[name]

    def _container(self, name: str) -> str:
        return f"infractl-{self.state.short_id}-{name}"

    def _pid_file(self, name: str) -> Path:
        return self.home / "run" / f"{name}.pid"

    def _shell(self, command: str, *, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        return self._host._ask(self._name, command, timeout=timeout)

    def _probe(self, name: str, host: str, port: int) -> int:
        """0: ``name`` runs and listens; 1: nothing listens; 2: something else does; 255: no answer."""
        engine = shlex.join(self._engine.argv)
        pid_file = shlex.quote(str(self._pid_file(name)))
        inspect = f"{engine} container inspect --format {shlex.quote('{{.State.Running}}')} {self._container(name)}"
        script = (
            f'ours() {{ [ "$({inspect} 2>/dev/null)" = true ]'
            f' || {{ test -f {pid_file} && kill -0 "$(cat {pid_file})" 2>/dev/null; }}; }}; '
            f"if timeout 2 bash -c {shlex.quote(f'exec 3<>/dev/tcp/{host}/{port}')} 2>/dev/null; "
            "then if ours; then exit 0; else exit 2; fi; else exit 1; fi"
        )
        return self._shell(script, timeout=30).returncode

    def keep(self, name: str, argv: Sequence[str], *, host: str, port: int, image: str | None = None) -> bool:
        probe = self._probe(name, host, port)
        if probe == 0:
            return False
        where = f"{self._name} ({self._host.node(self._name).address})"
        if probe == 2:
            raise InfractlError(
                f"the {name} server's port {host}:{port} on {where} is taken by another process; "
                "stop it, or run `infractl teardown` and `infractl up`"
            )
        if probe != 1:
            raise InfractlError(f"cannot start the {name} server: {where} does not answer SSH")
        log = self.home / "logs" / f"{name}.log"
        if image is not None:
            labels = {"org.infractl.cluster": str(self.state.dir), "org.infractl.server": name}
            command = shlex.join(
                [
                    *self._engine.argv,
                    "run",
                    "--detach",
                    f"--name={self._container(name)}",
                    "--replace",
                    "--pull=never",
                    "--network=host",
                    "--user=root",
                    *self._engine.run_options,
                    *(f"--label={key}={value}" for key, value in labels.items()),
                    image,
                    *argv,
                ]
            )
        else:
            pid_file = shlex.quote(str(self._pid_file(name)))
            inner = f"echo $$ >{pid_file} && exec {shlex.join(argv)} >>{shlex.quote(str(log))} 2>&1"
            command = (
                f"mkdir -p {shlex.quote(str(self._pid_file(name).parent))} && "
                f"setsid -f sh -c {shlex.quote(inner)} </dev/null >/dev/null 2>&1"
            )
        started = self._shell(f"mkdir -p {shlex.quote(str(log.parent))} && {command}")
        if started.returncode != 0:
            raise InfractlError(f"the {name} server did not start on {where}: {proc.last_line(started.stderr)}")
        deadline = time.monotonic() + SERVER_START_S
        while (probe := self._probe(name, host, port)) != 0:
            if time.monotonic() > deadline:
                raise InfractlError(f"the {name} server did not start on {where} (probe {probe}); see {log} there")
            time.sleep(1)
        return True

    def running(self, name: str, *, host: str, port: int) -> bool:
        return self._probe(name, host, port) == 0

    def put(self, path: Path, text: str) -> None:
        self._host.write_file(self._name, path, text)

    @contextmanager
    def reach(self, host: str, port: int) -> Iterator[tuple[str, int]]:
        """Through an SSH tunnel from this machine's loopback (``ssh -L``), open while the block runs."""
        login, address = self._host._login(self._name)
        local = free_port("127.0.0.1")
        argv = ["ssh", *login.options(), "-N", "-o", "ExitOnForwardFailure=yes"]
        argv += ["-L", f"127.0.0.1:{local}:{host}:{port}", "-l", login.user, address]
        tunnel = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            deadline = time.monotonic() + SERVER_START_S
            while not port_open("127.0.0.1", local):
                if tunnel.poll() is not None or time.monotonic() > deadline:
                    said = tunnel.stderr.read().decode() if tunnel.stderr and tunnel.poll() is not None else ""
                    raise InfractlError(f"no SSH tunnel to {host}:{port} through {address}: {proc.last_line(said)}")
                time.sleep(0.1)
            yield "127.0.0.1", local
        finally:
            tunnel.terminate()
            try:
                tunnel.wait(timeout=10)
            except subprocess.TimeoutExpired:
                tunnel.kill()
                tunnel.wait()

    def pull(self, reference: str, ca: Path) -> None:
        """Into the engine's own store, trusting ``ca`` from its ``certs/`` where it has one, else
        from the system-wide folder of the registry's host:port."""
        registry = reference.split("/", 1)[0]
        cert_dir = ""
        if self._engine.home is not None:
            self.put(self._engine.home / "certs" / "ca.crt", ca.read_text())
            cert_dir = f"--cert-dir {shlex.quote(str(self._engine.home / 'certs'))} "
        elif self._engine.certs_dir is not None:
            self.put(self._engine.certs_dir / registry / "ca.crt", ca.read_text())
        engine = shlex.join(self._engine.argv)
        quoted = shlex.quote(reference)
        pulled = self._shell(
            f"{engine} image inspect {quoted} >/dev/null 2>&1 || {engine} pull --quiet {cert_dir}{quoted}", timeout=900
        )
        if pulled.returncode != 0:
            raise InfractlError(f"{self._name} could not pull {reference}: {proc.last_line(pulled.stderr)}")

    def stop(self) -> tuple[int, list[str]]:
        """The servers' containers and processes; nothing to do when the host does not answer (it
        goes with the cluster's instances)."""
        engine = shlex.join(self._engine.argv)
        label = shlex.quote(f"label=org.infractl.cluster={self.state.dir}")
        run = shlex.quote(str(self.home / "run"))
        script = (
            f"n=0; for c in $({engine} ps -q --filter {label}); do "
            f"{engine} rm -f -t 0 $c >/dev/null && n=$((n+1)); done; "
            f'for f in {run}/*.pid; do [ -f "$f" ] || continue; '
            'if kill -9 "$(cat "$f")" 2>/dev/null; then n=$((n+1)); fi; rm -f "$f"; done; echo $n'
        )
        done = self._shell(script)
        if done.returncode != 0:
            return 0, []
        return int((done.stdout.split() or ["0"])[-1]), []

"""How a node runs containers (``ContainerEngine``: its engine's command, image store and options)
and the trainer image's contract every engine runs it by (its Python, its user, where its run's
files are mounted)."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from infractl import proc
from infractl.errors import InfractlError

__all__ = ["DOCKER", "IMAGE_PYTHON", "IMAGE_RUN_DIR", "IMAGE_UID", "ContainerEngine"]

#: The trainer image's Python, first on its PATH (images/trainer/README.md's contract).
IMAGE_PYTHON = "python"
#: The trainer image's user, ``trainer``, and its group (the same contract): the trainer's
#: container runs as it, so a node's root is never the trainer's.
IMAGE_UID = 10001
#: Where the trainer's container finds the files of its run that the launcher hands it (its spec,
#: its key), each mounted there alone and read-only: the folder they live in on the node is root's.
IMAGE_RUN_DIR = Path("/run/infractl")


@dataclass(frozen=True)
class ContainerEngine:
    """How a node runs containers (the ``container_runtime`` and ``trainer_image`` roles, and the
    launcher, run ``argv`` on the node)."""

    argv: tuple[str, ...]
    """The engine's command with the node's own options (its image store, runtime, cgroup manager)."""
    home: Path | None
    """The node's own image store and trusted registry CAs (``storage/``, ``certs/``); None where
    the engine keeps its system-wide ones (a Docker daemon)."""
    runroot: Path | None = None
    """The node's own run state (podman's ``--runroot``: a short path, sockets live there)."""
    run_options: tuple[str, ...] = ()
    """What ``run`` needs on this node besides the launcher's options (limits, devices)."""
    named_options: tuple[str, ...] = ()
    """What ``run`` needs for a named container (replacing one that a killed node left behind)."""
    certs_dir: Path | None = None
    """Where an engine with a system-wide store trusts a registry's CA: ``<certs_dir>/<host:port>/ca.crt``."""

    @classmethod
    def podman_own_store(
        cls, home: Path, runroot: Path, options: tuple[str, ...] = (), run_options: tuple[str, ...] = ()
    ) -> ContainerEngine:
        """podman with a store of its own (``home``: ``storage/``, ``certs/``) and run state of its
        own (``runroot``, libpod's among it: else every such engine of a machine shares
        /run/libpod), never the machine's system-wide ones; ``options`` after these."""
        return cls(
            argv=(
                "podman",
                "--root",
                str(home / "storage"),
                "--runroot",
                str(runroot),
                "--tmpdir",
                str(runroot / "libpod"),
                "--storage-driver",
                "overlay",
                *options,
            ),
            home=home,
            runroot=runroot,
            run_options=run_options,
            # A container of a run that a killed node left behind has the name the next start takes.
            named_options=("--replace",),
        )

    def run_prefix(
        self,
        *,
        name: str | None = None,
        labels: Mapping[str, str] | None = None,
        env: Iterable[str] = (),
        volumes: Iterable[Path] = (),
        files: Mapping[Path, Path] | None = None,
        workdir: Path | None = None,
        confined: bool = False,
    ) -> list[str]:
        """The command line before the image and its command that runs a container as a process
        of the node would run: in the node's network, PID and IPC namespaces (collectives bind the
        node's address; status, drills and ``kill`` find and signal its processes as the node's),
        never pulling (``up`` pulled and verified the image). ``confined`` (the trainer's: code a
        run brings runs there) runs as the image's user (``IMAGE_UID``) with no capability and no
        way to gain one (setuid binaries included); otherwise as root (infractl's own node side,
        which reads and signals every process of the node, the trainer's user's among them).
        ``env``: names of variables passed from the caller's environment; ``volumes``: folders at
        the same paths inside; ``files``: files of the node (keys) mounted read-only at the paths
        inside (values)."""
        return [
            *self.argv,
            "run",
            "--rm",
            *([f"--name={name}", *self.named_options] if name else []),
            "--pull=never",
            "--network=host",
            "--pid=host",
            "--ipc=host",
            *(
                [f"--user={IMAGE_UID}:{IMAGE_UID}", "--cap-drop=ALL", "--security-opt=no-new-privileges"]
                if confined
                # Reading another user's /proc/PID/environ (the trainer's markers) takes CAP_SYS_PTRACE.
                else ["--user=root", "--cap-add=SYS_PTRACE"]
            ),
            *([f"--workdir={workdir}"] if workdir else []),
            *self.run_options,
            *(f"--label={key}={value}" for key, value in (labels or {}).items()),
            *(f"--env={variable}" for variable in env),
            *(f"--volume={path}:{path}" for path in volumes),
            *(f"--volume={path}:{inside}:ro" for path, inside in (files or {}).items()),
        ]

    def remove_store(self) -> None:
        """Every container and image of the engine's own store (run from this machine, which holds
        it), then the store and the run root; ``InfractlError`` when the engine cannot. The engine
        unmounts what it mounted; what a reset cut short left mounted is unmounted here."""
        assert self.home is not None, "an engine with a system-wide store keeps it"
        for attempt in range(_RESET_ATTEMPTS):
            # A container killed a moment ago may still be removing its files from the run root
            # ("directory not empty"): the next attempt finds it gone.
            done = proc.run([*self.argv, "system", "reset", "--force"], timeout=120)
            if done.returncode == 0:
                break
            time.sleep(2 * (attempt + 1))
        if done.returncode != 0:
            raise InfractlError(f"could not remove its containers and images: {proc.last_line(done.stderr)}")
        proc.remove_tree(self.home)
        if self.runroot is not None:
            proc.remove_tree(self.runroot)


# How many times an engine's `system reset` runs before the removal of its store gives up.
_RESET_ATTEMPTS = 3


#: A GPU host's engine: Docker's daemon, with its system-wide store.
DOCKER = ContainerEngine(argv=("/usr/bin/docker",), home=None, certs_dir=Path("/etc/docker/certs.d"))

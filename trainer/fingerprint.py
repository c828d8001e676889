"""The environment a run trained in, recorded with its checkpoints and metrics so that a
result can be traced to the software and machine that produced it.

The source revision is recorded when the package is built: setup.py writes ``infractl/_revision.txt``
into every sdist and wheel, and an installed package never asks git. Only a checkout installed editable,
which nothing built, has no record: there ``git rev-parse HEAD`` of that checkout is the revision.
"""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
from importlib.resources import files
from pathlib import Path
from typing import TypedDict

import torch

import infractl
from infractl.proc import IMAGE_ENV

__all__ = [
    "CONTAINER_ENV",
    "Fingerprint",
    "environment_fingerprint",
    "git_revision",
    "running_image",
    "source_revision",
]

#: What podman tells every process of a container about it (``key="value"`` lines: ``image``, the
#: reference the container was made from, pinned by digest; ``imageid``). Absent on a host.
CONTAINER_ENV = Path("/run/.containerenv")

#: The revision record a build writes into the package (setup.py's REVISION).
_RECORDED_REVISION = "_revision.txt"
#: The trainer's own checkout (where ``git rev-parse`` is asked), not the working directory.
_CHECKOUT = Path(__file__).resolve().parents[1]
_GIT_TIMEOUT_S = 5.0


class Fingerprint(TypedDict):
    """Saved in each checkpoint's manifest (``extra["environment"]``) and in the first metrics
    record of every attempt (``environment``)."""

    torch: str
    python: str
    infractl: str
    git_revision: str | None  # source_revision(): None when the source was not a git checkout
    hostname: str
    world_size: int
    runtime: str  # "container" (in an image) or "host" (the node's own Python)
    interpreter: str  # the Python that ran, as a path in its runtime
    image: str | None  # the reference the container was made from (None on a host)
    image_digest: str | None  # that reference's manifest digest, sha256:... (None on a host)


def git_revision(checkout: Path = _CHECKOUT) -> str | None:
    """``git rev-parse HEAD`` of ``checkout``, or None (no git, not a checkout, too slow)."""
    try:
        done = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=checkout,
            capture_output=True,
            text=True,
            timeout=_GIT_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    revision = done.stdout.strip()
    return revision if done.returncode == 0 and revision else None


def source_revision() -> str | None:
    """The revision of the source infractl was installed from: the build's record, or for an
    editable checkout (no record) its ``git_revision``."""
    recorded = files("infractl") / _RECORDED_REVISION
    if recorded.is_file():
        return recorded.read_text().strip() or None
    return git_revision()


def running_image(container_env: Path = CONTAINER_ENV) -> dict[str, str] | None:
    """What the engine says, inside a container, about the container (``CONTAINER_ENV``'s keys and
    values); None on a host."""
    try:
        text = container_env.read_text()
    except FileNotFoundError:
        return None
    found: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            found[key.strip()] = value.strip().strip('"')
    return found


def environment_fingerprint(*, world_size: int) -> Fingerprint:
    """Collect the fingerprint; may run ``git`` (see ``source_revision``), so call it once per process.
    The image is what the container engine says ran (a privileged podman container's
    ``CONTAINER_ENV``), else the digest-pinned reference the launcher had the engine run
    (``$INFRACTL_IMAGE``: the engine runs nothing else under it), never what a config asked for."""
    container = running_image()
    image = (container or {}).get("image") or os.environ.get(IMAGE_ENV) or None
    return Fingerprint(
        torch=torch.__version__,
        python=platform.python_version(),
        infractl=infractl.__version__,
        git_revision=source_revision(),
        hostname=socket.gethostname(),
        world_size=world_size,
        runtime="host" if container is None and image is None else "container",
        interpreter=sys.executable,
        image=image,
        image_digest=image.rpartition("@")[2] if image and "@sha256:" in image else None,
    )

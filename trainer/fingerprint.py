"""The environment a run trained in, recorded with its checkpoints and metrics so that a
result can be traced to the software and machine that produced it."""

from __future__ import annotations

import os
import platform
import socket
import subprocess
from pathlib import Path
from typing import TypedDict

import torch

import infractl

__all__ = ["Fingerprint", "RUNTIME_IMAGE_ENV", "environment_fingerprint", "git_revision"]

#: Set by the config driver on nodes that run the pinned runtime image.
RUNTIME_IMAGE_ENV = "INFRACTL_RUNTIME_IMAGE"

#: The trainer's own checkout (where ``git rev-parse`` is asked), not the working directory.
_CHECKOUT = Path(__file__).resolve().parents[1]
_GIT_TIMEOUT_S = 5.0


class Fingerprint(TypedDict):
    """Saved in each checkpoint's manifest (``extra["environment"]``) and in the first metrics
    record of every attempt (``environment``)."""

    torch: str
    python: str
    infractl: str
    git_revision: str | None  # None outside a git checkout (an installed package, say)
    hostname: str
    world_size: int
    runtime_image: str | None  # $INFRACTL_RUNTIME_IMAGE; None when unset


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


def environment_fingerprint(*, world_size: int) -> Fingerprint:
    """Collect the fingerprint; runs ``git`` once, so call it once per process."""
    return Fingerprint(
        torch=torch.__version__,
        python=platform.python_version(),
        infractl=infractl.__version__,
        git_revision=git_revision(),
        hostname=socket.gethostname(),
        world_size=world_size,
        runtime_image=os.environ.get(RUNTIME_IMAGE_ENV) or None,
    )

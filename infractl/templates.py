"""The template folders infractl ships (infra, playbooks, runbooks, bundle), wherever this install keeps them."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

__all__ = ["folder"]

#: Where a built package (wheel, sdist) keeps the folders: setup.py copies them there.
_PACKAGED = "_templates"


def folder(name: str) -> Path:
    """The template folder ``name`` (``infra``, ``playbooks``, ``runbooks`` or ``bundle``) on disk.

    A built package carries it as ``infractl/_templates/<name>``; an editable install has no copy, and
    reads the checkout's own ``<name>/`` beside ``infractl/``, so an edit there takes effect at once.
    Terraform and ansible-runner read these folders in place, which needs the package unpacked on disk
    (as pip installs every wheel).
    """
    package = Path(str(files("infractl")))
    built = package / _PACKAGED
    return (built if built.is_dir() else package.parent) / name

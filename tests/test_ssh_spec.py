"""cluster.yaml's ``ssh:`` section (infractl/providers/ssh/spec.py) and the logins it makes: paths
relative to cluster.yaml, the rules across fields, each refusal one line naming the field; a
node's port and jump host in its ssh command line and its record (unit: no host is reached)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from infractl import providers
from infractl.config import load_cluster
from infractl.errors import ConfigError
from infractl.node import Node, SshLogin
from infractl.providers.ssh.spec import SshSpec
from infractl.statedir import ClusterState

from conftest import REPO

DIGEST = "sha256:" + "a" * 64


def _write(tmp_path: Path, **ssh: object) -> Path:
    spec = {
        "name": "lab",
        "provider": "ssh",
        "store": "s3://team-bucket/infractl",
        "runtime": {"image": f"infractl/trainer@{DIGEST}"},
        "ssh": {
            "user": "ubuntu",
            "key": "keys/lab_ed25519",
            "known_hosts": "lab_known_hosts",
            "hosts": [
                {"name": "gpu-a", "address": "10.1.0.11"},
                {"name": "gpu-b", "address": "10.1.0.12", "port": 2222},
            ],
            "controller": {"address": "10.1.0.5"},
            **ssh,
        },
    }
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_files_are_relative_to_cluster_yaml_and_nodes_default_to_the_hosts(tmp_path: Path) -> None:
    spec = load_cluster(_write(tmp_path))
    ssh = spec.settings(SshSpec)
    assert ssh is not None
    assert (ssh.key, ssh.known_hosts) == (str(tmp_path / "keys/lab_ed25519"), str(tmp_path / "lab_known_hosts"))
    assert spec.nodes == 2
    # Kept absolute: the cluster record is read again from anywhere.
    assert providers.get("ssh").config.section is SshSpec
    assert spec.model_dump(mode="json")["ssh"]["key"] == str(tmp_path / "keys/lab_ed25519")


@pytest.mark.parametrize(
    ("changes", "field", "said"),
    [
        (
            {"hosts": [{"name": "a", "address": "10.1.0.11"}, {"name": "a", "address": "10.1.0.12"}]},
            "ssh.hosts",
            "'a' appears twice",
        ),
        (
            {"hosts": [{"name": "a", "address": "10.1.0.11"}, {"name": "b", "address": "10.1.0.11"}]},
            "ssh.hosts",
            "named twice",
        ),
        ({"controller": "local", "jump": {"address": "bastion.lab"}}, "ssh.controller", "jump host"),
        ({"hosts": [{"name": "a", "address": "127.0.0.1"}]}, "ssh.hosts", "loopback"),
        ({"workdir": "/srv"}, "ssh.workdir", "two levels deep"),
        ({"device": "tpu"}, "ssh.device", "catalog"),
        ({"hosts": [{"name": "a", "address": "10.1.0.11; rm -rf /"}]}, "ssh.hosts[0].address", "pattern"),
    ],
)
def test_a_bad_section_is_refused_naming_its_field(
    tmp_path: Path, changes: dict[str, object], field: str, said: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        load_cluster(_write(tmp_path, **changes))
    assert refused.value.field == field and said in refused.value.message, (refused.value.field, refused.value.message)


def test_the_trainer_image_and_a_shared_store_are_required(tmp_path: Path) -> None:
    path = _write(tmp_path)
    text = yaml.safe_load(path.read_text())
    del text["runtime"]
    path.write_text(yaml.safe_dump(text))
    with pytest.raises(ConfigError, match="is required with provider ssh") as refused:
        load_cluster(path)
    assert refused.value.field == "runtime.image"
    text["runtime"] = {"image": f"infractl/trainer@{DIGEST}"}
    del text["store"]
    path.write_text(yaml.safe_dump(text))
    with pytest.raises(ConfigError, match="every host reaches") as refused:
        load_cluster(path)
    assert refused.value.field == "store"


def test_a_login_carries_its_port_and_jump_host_to_ssh_and_the_record() -> None:
    login = SshLogin("ops", Path("/k"), Path("/kh"), jump="ssh://ops@bastion.lab:2200", port=2222)
    argv = login.argv("10.1.0.12", "true")
    assert "Port=2222" in argv and argv[-4:] == ["-l", "ops", "10.1.0.12", "true"]
    proxy = next(option for option in argv if option.startswith("ProxyCommand="))
    # The jump host is reached on its own port, not the node's.
    assert "Port=2222" not in proxy and proxy.endswith("-W %h:%p ssh://ops@bastion.lab:2200")
    node = Node("gpu-b", "10.1.0.12", Path("/var/lib/infractl/lab"), 1, ssh=login)
    assert Node.from_record(node.record()) == node
    assert SshLogin("root", Path("/k"), Path("/kh")).options().count("Port=22") == 0


def test_the_example_loads_as_the_docs_describe_it() -> None:
    example = REPO / "examples" / "ssh" / "cluster.yaml"
    spec = load_cluster(example)
    ssh = spec.settings(SshSpec)
    assert ssh is not None and ssh.jump is not None and not isinstance(ssh.controller, str)
    assert (spec.nodes, spec.processes_per_node, [h.gpus for h in ssh.hosts]) == (2, 8, [8, 8])
    assert ssh.known_hosts == str(example.parent / "lab_known_hosts") and ssh.key == str(
        Path("~/.ssh/lab_ed25519").expanduser()
    )
    # A dry run reaches no host: it says what `up` would do to the team's machines.
    plan = providers.get("ssh").dry_run(spec, ClusterState("lab", REPO / ".infractl" / "lab"))
    assert (plan.module, plan.resources, plan.cost) == (None, (), None) and "10.1.0.11" in plan.cost_note

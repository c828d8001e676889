"""The GPU node roles (playbooks/gpu.yml, run on the inventory's group gpu) in check
mode on this machine.

Each node is described by a fact fixture (tests/fixtures/gpu_facts/): what a real node's probes would
read (nvidia-smi, its PCI devices, docker image inspect, its default route) and, for the health gate,
the output of nccl-tests across the nodes. Given those, the roles skip their probes and run every
assertion, template and comparison against them; commands that would change a node do not run in
check mode. The systemctl of these nodes is tests/fixtures/gpu_facts/bin/systemctl (no systemd here).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ansible_runner
import pytest
import yaml

from infractl.playbook import container_vars, playbook_dir
from infractl.providers.aws.nodes import engine_for

from conftest import REPO

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "gpu_facts"
VENV_BIN = Path(sys.executable).parent
# ansible-lint lives in the tools venv (scripts/tools.sh, tools-constraints.txt) with checkov.
TOOLS_BIN = playbook_dir().parent / ".venv-tools" / "bin"
# The image the fixtures' nodes hold (their `docker image inspect` lists this digest).
IMAGE = (
    "123456789012.dkr.ecr.us-east-1.amazonaws.com/infractl/trainer"
    "@sha256:895747542690d408428ed48b7fdbda3b8e4ee5965b8be88c4f776b42dec0d174"
)


@dataclass
class Play:
    """One check-mode run of a playbook: its status and ansible-runner's events."""

    status: str
    events: list[dict[str, Any]]
    changed: int
    """Changed tasks over all nodes."""

    def _results(self, event: str) -> list[dict[str, Any]]:
        return [e["event_data"] for e in self.events if e.get("event") == event]

    def failures(self) -> list[tuple[str, str, str]]:
        """(node, role, message) of every failed task."""
        return [(d["host"], d.get("role", ""), d["res"]["msg"]) for d in self._results("runner_on_failed")]

    def result(self, task: str) -> dict[str, Any]:
        """The result of ``task`` on the first node it ran on."""
        return next(d["res"] for d in self._results("runner_on_ok") if d.get("task") == task)

    def roles_run(self) -> set[str]:
        return {d.get("role", "") for d in self._results("runner_on_ok")}

    def rendered(self, task: str) -> dict[str, str]:
        """Node -> the file content a template task would write (check mode with --diff)."""
        found = {}
        for data in self._results("runner_on_ok"):
            if data.get("task") == task:
                diffs = data["res"]["diff"]
                found[data["host"]] = (diffs if isinstance(diffs, list) else [diffs])[0]["after"]
        return found

    def facts(self, name: str) -> dict[str, Any]:
        """Node -> the last value its tasks set for fact ``name``."""
        found = {}
        for data in self._results("runner_on_ok"):
            value = data["res"].get("ansible_facts", {}).get(name)
            if value is not None:
                found[data["host"]] = value
        return found


def _facts(fixture: str) -> dict[str, Any]:
    facts: dict[str, Any] = yaml.safe_load((FIXTURES / f"{fixture}.yml").read_text())
    return facts


def _printed_busbw(nccl_tests: str) -> float:
    """The average bus bandwidth the fixture's nccl-tests output prints."""
    text = (FIXTURES / f"nccl_tests_{nccl_tests}.txt").read_text()
    return float(re.search(r"^# Avg bus bandwidth\s*:\s*([0-9.]+)", text, re.MULTILINE).group(1))  # type: ignore[union-attr]


def _catalog(instance_type: str) -> dict[str, Any]:
    """The instance type's entry in infra/aws/instances.json."""
    entry: dict[str, Any] = json.loads((REPO / "infra" / "aws" / "instances.json").read_text())["instance_types"][
        instance_type
    ]
    return entry


def _image_versions(fixture: str) -> tuple[str, str]:
    """The NCCL and aws-ofi-nccl versions the fixture node's image labels name."""
    text = (FIXTURES / f"{fixture}.yml").read_text()
    found = {k: v for k, v in re.findall(r'"org\.infractl\.([a-z-]+)\.version": "([^"]+)"', text)}
    return found["nccl"], found["aws-ofi-nccl"]


def _node(fixture: str | dict[str, Any], index: int, tmp_path: Path) -> dict[str, Any]:
    workdir = tmp_path / f"node-{index}"
    workdir.mkdir(exist_ok=True)
    facts = _facts(fixture) if isinstance(fixture, str) else fixture
    # A GPU node's engine as the provider's node control gives it to the inventory (Docker's daemon,
    # with the GPUs and, where the type has them, the EFA devices).
    return (
        facts
        | container_vars(engine_for(facts["node_instance_type"]))
        | {
            "ansible_connection": "local",
            "ansible_python_interpreter": sys.executable,
            "node_workdir": str(workdir),
            "node_address": f"10.0.1.{23 + index}",
            "node_index": index,
        }
    )


def check(
    tmp_path: Path,
    playbook: str,
    nodes: list[str | dict[str, Any]],
    *,
    nccl_tests: str | None = None,
    extravars: dict[str, Any] | None = None,
    check_mode: bool = True,
) -> Play:
    """Run ``playbook`` with --check --diff on nodes made from fixtures (``nodes``: fixture names or facts),
    with nccl-tests' output from ``nccl_tests_<nccl_tests>.txt`` as the health gate's sweep.
    ``check_mode=False`` applies it: with every probe given, only the nodes' work dirs change."""
    gpu: dict[str, Any] = {"hosts": {f"node-{i}": _node(name, i, tmp_path) for i, name in enumerate(nodes)}}
    if nccl_tests is not None:
        output = (FIXTURES / f"nccl_tests_{nccl_tests}.txt").read_text()
        gpu["vars"] = {"nccl_health_result": {"rc": 0, "stdout": output, "stderr": ""}}
    data_dir = tmp_path / "ansible"
    data_dir.mkdir(exist_ok=True)
    inventory = data_dir / "hosts.json"
    inventory.write_text(json.dumps({"all": {"children": {"gpu": gpu}}}))
    runner = ansible_runner.run(
        private_data_dir=str(data_dir),
        project_dir=str(playbook_dir()),
        playbook=playbook,
        inventory=str(inventory),
        extravars={"runtime_image": IMAGE, **(extravars or {})},
        envvars={
            # The nodes' systemctl first; ansible-playbook lives next to this Python.
            "PATH": os.pathsep.join([str(FIXTURES / "bin"), str(VENV_BIN), os.environ.get("PATH", "")]),
            "ANSIBLE_PIPELINING": "True",
            "ANSIBLE_NOCOLOR": "1",
            "ANSIBLE_LOCAL_TEMP": str(data_dir / "tmp"),
            "ANSIBLE_RETRY_FILES_ENABLED": "False",
        },
        cmdline="--check --diff" if check_mode else "--diff",
        quiet=True,
        suppress_env_files=True,
    )
    changed = sum((runner.stats or {}).get("changed", {}).values())
    return Play(status=runner.status, events=list(runner.events), changed=changed)


def _env_file(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines() if line and not line.startswith("#"))


def test_p5_nodes_pass_with_nccl_over_efa(tmp_path: Path) -> None:
    play = check(tmp_path, "gpu.yml", ["p5", "p5"], nccl_tests="p5")

    assert play.status == "successful", play.failures()
    env = _env_file(play.rendered("Write the NCCL environment file")["node-0"])
    assert env["FI_PROVIDER"] == "efa"
    assert env["FI_EFA_USE_DEVICE_RDMA"] == "1"
    assert env["NCCL_NET"] == "AWS Libfabric"
    assert env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == "enp71s0"
    assert env["INFRACTL_NODE_ADDRESS"] == "10.0.1.23"
    report = play.facts("health_report")
    assert sorted(report) == ["node-0", "node-1"]
    assert report["node-0"] | {"node": "node-1", "rank": 1} == report["node-1"]
    assert report["node-0"]["measured"] is True
    # What the sweep printed, the type's floor in the catalog, the versions the image's labels name.
    assert report["node-0"]["busbw_gbps"] == _printed_busbw("p5")
    assert report["node-0"]["busbw_min_gbps"] == _catalog("p5.48xlarge")["nccl_min_busbw_gb_per_s"]
    assert (report["node-0"]["gpus"], report["node-0"]["world"]) == (2 * _catalog("p5.48xlarge")["gpus"], 2)
    assert (report["node-0"]["nccl"], report["node-0"]["aws_ofi_nccl"]) == _image_versions("p5")


def test_g5_nodes_pass_with_nccl_over_tcp_sockets(tmp_path: Path) -> None:
    play = check(tmp_path, "gpu.yml", ["g5", "g5"], nccl_tests="g5")

    assert play.status == "successful", play.failures()
    env = _env_file(play.rendered("Write the NCCL environment file")["node-1"])
    assert "FI_PROVIDER" not in env
    assert "FI_EFA_USE_DEVICE_RDMA" not in env
    assert env["NCCL_NET"] == "Socket"
    assert env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == "ens5"
    report = play.facts("health_report")["node-1"]
    g5 = _catalog("g5.12xlarge")
    assert (report["busbw_gbps"], report["busbw_min_gbps"]) == (_printed_busbw("g5"), g5["nccl_min_busbw_gb_per_s"])
    assert report["gpus"] == 2 * g5["gpus"]


def test_a_missing_efa_device_fails_preflight_naming_it(tmp_path: Path) -> None:
    play = check(tmp_path, "gpu.yml", ["p5", "p5_missing_efa"], nccl_tests="p5")

    assert play.status == "failed"
    assert play.failures() == [
        (
            "node-1",
            "gpu_preflight",
            "node-1: p5.48xlarge needs 32 EFA devices, found 31 "
            "(missing: rdmap199s0 at 0000:c7:00.0, which the efa driver did not register)",
        )
    ]
    # One node failing its preflight stops every node before anything is installed or pulled.
    assert play.roles_run().isdisjoint({"container_runtime", "trainer_image", "nccl_env", "nccl_health"})


def _old_driver() -> dict[str, Any]:
    facts = _facts("p5")
    smi = facts["gpu_preflight_probe"]["nvidia_smi"]
    smi["stdout"] = smi["stdout"].replace("580.95.05", "570.133.20")
    return facts


def _gpu_off_the_bus() -> dict[str, Any]:
    """The p5 node after an Xid 79: the GPU at 0000:a8:00.0 is still on the PCI bus, the driver lost it."""
    facts = _facts("p5")
    smi = facts["gpu_preflight_probe"]["nvidia_smi"]
    smi["stdout"] = "".join(line + "\n" for line in smi["stdout"].splitlines() if not line.startswith("00000000:A8"))
    return facts


@pytest.mark.parametrize(
    ("node", "message"),
    [
        (
            _old_driver(),
            "node-1: NVIDIA driver 570.133.20 is older than 580.65.06, the oldest the trainer image's CUDA runs on",
        ),
        (
            _gpu_off_the_bus(),
            "node-1: p5.48xlarge needs 8 GPUs, nvidia-smi sees 7 "
            "(missing: 0000:a8:00.0: on the PCI bus but not seen by the driver)",
        ),
    ],
    ids=["old-driver", "gpu-off-the-bus"],
)
def test_preflight_names_what_is_wrong_with_the_driver(tmp_path: Path, node: dict[str, Any], message: str) -> None:
    play = check(tmp_path, "gpu.yml", ["p5", node], nccl_tests="p5")

    assert play.status == "failed"
    assert play.failures() == [("node-1", "gpu_preflight", message)]


def test_low_bus_bandwidth_fails_the_health_gate_with_figure_and_threshold(tmp_path: Path) -> None:
    play = check(tmp_path, "gpu.yml", ["p5", "p5"], nccl_tests="p5_degraded")

    assert play.status == "failed"
    assert play.failures() == [
        (
            "node-0",
            "nccl_health",
            "node-0: all_reduce bus bandwidth 11.715 GB/s across 2 nodes (16 GPUs) is below 200 GB/s, "
            "the threshold for p5.48xlarge (nccl-tests 512M to 2G)",
        )
    ]


def test_an_image_without_the_pinned_digest_fails_verification(tmp_path: Path) -> None:
    pinned = IMAGE.split("@")[0] + "@sha256:" + "0" * 64

    play = check(tmp_path, "gpu.yml", ["g5"], nccl_tests="g5", extravars={"runtime_image": pinned})

    assert play.status == "failed"
    [(node, role, message)] = play.failures()
    assert (node, role) == ("node-0", "trainer_image")
    assert message.startswith(f"node-0: image {pinned} is pinned, but the image the node holds under that name has")
    assert IMAGE in message


def test_check_mode_assembles_the_health_sweep_without_running_it(tmp_path: Path) -> None:
    play = check(tmp_path, "gpu.yml", ["p5", "p5"])

    assert play.status == "successful", play.failures()
    sweep = play.facts("_nccl_health_sweep_argv")["node-0"]
    assert sweep[:4] == ["/usr/bin/docker", "exec", "infractl-nccl-health", "/opt/amazon/openmpi/bin/mpirun"]
    assert sweep[sweep.index("--host") + 1] == "10.0.1.23:8,10.0.1.24:8"
    assert sweep[sweep.index("-np") + 1] == "16"
    assert {"FI_PROVIDER=efa", "NCCL_NET=AWS Libfabric", "NCCL_SOCKET_IFNAME=enp71s0"} <= set(sweep)
    assert sweep[-11:] == ["/opt/nccl-tests/all_reduce_perf", *"-b 512M -e 2G -f 2 -g 1 -c 1".split()]
    container = play.facts("_nccl_health_container_argv")["node-1"]
    # The same run options as the trainer's container (engine_for: a p5 has GPUs and EFA).
    assert {"--device=/dev/infiniband", "--gpus=all", "--ulimit=memlock=-1", "--network=host"} <= set(container)
    assert IMAGE in container
    assert all(not report["measured"] for report in play.facts("health_report").values())
    # The check's SSH key is made on the controller even in check mode, and removed after it.
    assert not Path(play.result("Make a directory for this check's SSH key on the controller")["path"]).exists()


def test_a_second_configure_changes_nothing(tmp_path: Path) -> None:
    first = check(tmp_path, "gpu.yml", ["p5", "p5"], nccl_tests="p5", check_mode=False)
    again = check(tmp_path, "gpu.yml", ["p5", "p5"], nccl_tests="p5", check_mode=False)

    assert (first.status, again.status) == ("successful", "successful"), first.failures() + again.failures()
    assert first.changed == 4  # per node: the private directory and the NCCL environment file
    assert again.changed == 0
    written = _env_file((tmp_path / "node-1" / "private" / "nccl.env").read_text())
    assert written["INFRACTL_NODE_ADDRESS"] == "10.0.1.24"


def test_pci_devices_reads_gpus_and_efa_from_sysfs(tmp_path: Path) -> None:
    pci = tmp_path / "bus" / "pci" / "devices"

    def function(address: str, vendor: str, device: str, cls: str) -> Path:
        path = pci / address
        path.mkdir(parents=True)
        for name, value in (("vendor", vendor), ("device", device), ("class", cls)):
            (path / name).write_text(value + "\n")
        return path

    function("0000:53:00.0", "0x10de", "0x2330", "0x030200")  # H100
    function("0000:07:00.0", "0x10de", "0x22a3", "0x068000")  # NVSwitch: a bridge, not a GPU
    registered = function("0000:4f:00.0", "0x1d0f", "0xefa1", "0x020000")
    function("0000:c7:00.0", "0x1d0f", "0xefa1", "0x020000")  # attached, no RDMA device
    function("0000:20:00.0", "0x1d0f", "0xec20", "0x020000")  # ENA
    rdma = tmp_path / "class" / "infiniband" / "rdmap79s0"
    rdma.mkdir(parents=True)
    (rdma / "device").symlink_to(registered)
    script = playbook_dir() / "roles" / "gpu_preflight" / "files" / "pci_devices.py"

    printed = subprocess.run([sys.executable, str(script), str(tmp_path)], check=True, capture_output=True).stdout

    assert json.loads(printed) == {
        "gpus": ["0000:53:00.0"],
        "efa": ["0000:4f:00.0", "0000:c7:00.0"],
        "rdma": {"rdmap79s0": "0000:4f:00.0"},
    }


def test_ansible_lint_production_profile_passes_over_playbooks() -> None:
    ansible_lint = TOOLS_BIN / "ansible-lint"
    if not ansible_lint.exists():
        pytest.fail(f"{ansible_lint} is missing: run scripts/tools.sh (it creates .venv-tools with ansible-lint)")

    result = subprocess.run(
        [str(ansible_lint), "--offline", "--nocolor", "--profile", "production", "playbooks"],
        cwd=playbook_dir().parent,
        # ansible-lint runs the ansible-playbook of its own venv.
        env={**os.environ, "PATH": os.pathsep.join([str(TOOLS_BIN), os.environ.get("PATH", "")])},
        capture_output=True,
        text=True,
        timeout=300,
    )

    assert result.returncode == 0, result.stdout + result.stderr
    assert "Profile 'production' was required, and it passed." in result.stdout + result.stderr
